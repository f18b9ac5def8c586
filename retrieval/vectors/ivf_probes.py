"""How many IVF lists a filtered search probes: a table the index measures on its own rows when it is trained.

How many lists an IVF search must probe to find the true top k depends on the data (how tightly it
gathers round the centroids) and on the ACL filter: with a fraction f of the rows readable, the k-th
readable neighbour is about the (k/f)-th neighbour overall, further out and spread over more lists.
No fixed rule fits both a clustered corpus (a few lists are enough) and a near-isotropic one (a third
of the lists is not), so at (re)training `calibrate` measures it: for a ladder of fractions (1, 1/2,
1/5, 1/10, ... down to where the exact path takes over) it finds the smallest nprobe whose recall@k,
against exact search over the same readable rows, reaches `TARGET_RECALL` on calibration queries under
a random allow-list of that fraction. A search takes the entry of the next stricter fraction.

Calibration queries are stored rows moved off the data by Gaussian noise of the row's own norm
(cosine ~0.7 to the row), the row itself left out of the truth and of the answers. A real query is not
a stored row: a row used as is finds itself, and its own list first, and would flatter the index; the
noise puts the query between the row and the rest of the space, as a question sits off its passage.
The allow-lists are random, so a filter correlated with the vectors (a group whose documents sit far
from the query) is not what was measured; a search that finds fewer than k still falls back to exact.

Cost: one pass of exact scoring (queries x live rows, in chunks, nested prefixes of one random order
give every fraction's truth at once) and a doubling-then-bisection search over nprobe per fraction,
each step one batched Faiss search of all the queries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

# Filter fractions calibrated, broadest first; the ladder stops at the first one that leaves at most
# max(exact_below, MIN_ROWS) readable rows (the exact path answers below exact_below).
FRACTIONS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0005, 0.0002, 0.0001)
MIN_ROWS = 1000
TARGET_RECALL = 0.97  # on calibration queries; margin for a 0.95 goal on real ones
NUM_QUERIES = 200
NOISE = 1.0  # calibration query = row + Gaussian noise of this times the row's norm
K = 10
CHUNK = 65536  # rows scored at a time for the exact truth


@dataclass(frozen=True)
class ProbeTable:
    """Smallest nprobe reaching `target` recall@k per filter fraction, as measured at training."""

    fractions: tuple[float, ...]  # descending from 1.0
    nprobes: tuple[int, ...]  # non-decreasing
    recalls: tuple[float, ...]  # the recall measured at each entry's nprobe
    k: int
    target: float
    seconds: float  # wall time of the calibration

    def nprobe_for(self, fraction: float) -> int:
        """Probes for a filter that keeps `fraction` of the live rows.

        The entry of the next stricter (smaller or equal) fraction; below the ladder, the last entry
        scaled by how many times more selective the filter is (a conservative, linear guess).
        """
        for f, p in zip(self.fractions, self.nprobes, strict=True):
            if f <= fraction:
                return p
        f, p = self.fractions[-1], self.nprobes[-1]
        return math.ceil(p * f / max(fraction, 1e-12))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The table as arrays for an index file (`from_arrays` reads them back)."""
        return {"probe_fractions": np.asarray(self.fractions, dtype=np.float64),
                "probe_nprobes": np.asarray(self.nprobes, dtype=np.int64),
                "probe_recalls": np.asarray(self.recalls, dtype=np.float64),
                "probe_meta": np.asarray([self.k, self.target, self.seconds], dtype=np.float64)}

    @classmethod
    def from_arrays(cls, data) -> ProbeTable | None:
        """The table in an index file's arrays, or None for a file written before there was one."""
        if "probe_fractions" not in data.files:
            return None
        k, target, seconds = (float(v) for v in data["probe_meta"])
        return cls(tuple(float(f) for f in data["probe_fractions"]), tuple(int(p) for p in data["probe_nprobes"]),
                   tuple(float(r) for r in data["probe_recalls"]), int(k), target, seconds)

    def describe(self) -> str:
        """One line: fraction -> nprobe (recall), for logs and benchmarks."""
        steps = ", ".join(f"{f:g}: {p} ({r:.3f})" for f, p, r in zip(self.fractions, self.nprobes, self.recalls,
                                                                   strict=True))
        return f"nprobe for recall@{self.k} >= {self.target} by readable fraction: {steps}; {self.seconds:.1f} s"


def calibrate(index: faiss.IndexIVF, vecs: np.ndarray, labels: np.ndarray,
              selector: Callable[[np.ndarray], faiss.IDSelector], min_rows: int = MIN_ROWS, *,
              k: int = K, target: float = TARGET_RECALL, num_queries: int = NUM_QUERIES, seed: int = 0
              ) -> ProbeTable:
    """Measure the smallest nprobe reaching `target` recall@k at each filter fraction of FRACTIONS.

    Args:
        index: a trained IVF index holding `labels` (inner product).
        vecs: the rows by label.
        labels: the live labels (the rows the fractions are of).
        selector: labels -> an ID selector admitting just those labels.
        min_rows: the ladder stops at the first fraction leaving at most this many readable rows.
        k, target, num_queries: recall@k target and how many calibration queries.
        seed: for the query sample, the noise and the allow-lists (a build is reproducible).

    Returns:
        The table; its fractions are those of the ladder that leave more than k readable rows.
    """
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    m, nlist = len(labels), int(index.nlist)
    source = rng.choice(labels, size=min(num_queries, m), replace=False)
    rows = vecs[source]
    noise = rng.standard_normal(rows.shape).astype(np.float32)
    noise *= NOISE * np.linalg.norm(rows, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
    queries = np.ascontiguousarray(rows + noise, dtype=np.float32)
    ladder: list[tuple[float, int]] = []  # (fraction, readable rows: a prefix of `order`)
    for f in FRACTIONS:
        count = min(m, math.ceil(f * m))
        if count <= k:
            break
        ladder.append((f, count))
        if count <= max(min_rows, k):
            break
    order = rng.permutation(labels)  # allow-list of fraction f: order[:ceil(f * m)], nested
    truth = _exact_truth(queries, source, vecs, order, sorted({c for _, c in ladder}), k)

    fractions, nprobes, recalls = [], [], []
    start = 1
    for f, count in ladder:
        sel = selector(order[:count])
        cache: dict[int, float] = {}

        def recall(p: int, sel=sel, want=truth[count], cache=cache) -> float:
            if p not in cache:
                cache[p] = _recall(index, queries, source, want, k, p, sel)
            return cache[p]

        p = _smallest_nprobe(recall, start, nlist, target)
        fractions.append(f)
        nprobes.append(p)
        recalls.append(recall(p))
        start = p  # a stricter filter never needs fewer probes
    return ProbeTable(tuple(fractions), tuple(nprobes), tuple(recalls), k, target, time.perf_counter() - started)


def _smallest_nprobe(recall: Callable[[int], float], start: int, nlist: int, target: float) -> int:
    """Doubling from `start`, then bisection to within 1/16: recall only grows with nprobe (probed lists nest)."""
    if recall(start) >= target:
        return start
    lo = hi = start  # recall(lo) < target
    while hi < nlist:
        hi = min(nlist, 2 * hi)
        if recall(hi) >= target:
            break
        lo = hi
    else:
        return nlist  # even every list misses the target (ties): probe them all
    while hi - lo > max(1, hi // 16):
        mid = (lo + hi) // 2
        if recall(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def _recall(index: faiss.IndexIVF, queries: np.ndarray, source: np.ndarray, truth: np.ndarray, k: int, nprobe: int,
            sel: faiss.IDSelector) -> float:
    """Mean recall@k of a filtered search at `nprobe`, each query's source row left out of its answer."""
    _, found = index.search(queries, k + 1, params=faiss.SearchParametersIVF(nprobe=nprobe, sel=sel))
    own = found == source[:, None]
    found[own] = -1
    found[~own.any(axis=1), k] = -1  # source not found: its (k+1)-th answer is not in its top k
    hits = (found[:, :, None] == truth[:, None, :]).any(axis=2) & (found >= 0)
    return float(hits.sum() / truth.size)


def _exact_truth(queries: np.ndarray, source: np.ndarray, vecs: np.ndarray, order: np.ndarray, ends: list[int],
                 k: int) -> dict[int, np.ndarray]:
    """Exact top k (labels, (queries, k)) over each prefix order[:end], sources excluded, in one pass."""
    nq = len(queries)
    best_s = np.full((nq, 0), -np.inf, dtype=np.float32)
    best_l = np.empty((nq, 0), dtype=np.int64)
    truth: dict[int, np.ndarray] = {}
    s = 0
    for end in ends:
        while s < end:
            block = order[s:min(end, s + CHUNK)]
            # k + 1 per block (BLAS, all cores): one of them may be the query's own row
            scores, idx = faiss.knn(queries, vecs[block], k + 1, metric=faiss.METRIC_INNER_PRODUCT)
            found = np.where(idx >= 0, block[np.maximum(idx, 0)], -1)
            scores[(found == source[:, None]) | (found < 0)] = -np.inf  # a query's own row is never its answer
            best_s = np.concatenate([best_s, scores], axis=1)
            best_l = np.concatenate([best_l, found], axis=1)
            top = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
            best_s, best_l = np.take_along_axis(best_s, top, 1), np.take_along_axis(best_l, top, 1)
            s += len(block)
        truth[end] = best_l.copy()
    return truth
