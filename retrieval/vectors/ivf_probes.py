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
(cosine ~0.7 to the row), the row itself left out of its truth. A real query is not a stored row: a
row used as is finds itself, and its own list first, and would flatter the index; the noise puts the
query between the row and the rest of the space, as a question sits off its passage. On the clustered
synthetic data of bench/filtered_search.py this is the harder case: real queries drawn like the rows
reach 0.98-1.0 at the nprobe that gives these 0.97.
The allow-lists are random, so a filter correlated with the vectors (a group whose documents sit far
from the query) is not what was measured; a search that finds fewer than k still falls back to exact.

Cost: one pass of exact scoring (queries x live rows, in chunks; nested prefixes of one random order
give every fraction's truth at once) and one ranking of the centroids per query. No search over
nprobe is run: a filtered IVF search finds a true neighbour exactly when its list is among the probed
ones, so each neighbour's list rank gives the whole recall-against-nprobe curve at once.
"""

from __future__ import annotations

import math
import time
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
    recalls: tuple[float, ...]  # the calibration queries' recall at each entry's nprobe
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


def calibrate(index: faiss.IndexIVF, vecs: np.ndarray, labels: np.ndarray, min_rows: int = MIN_ROWS, *,
              k: int = K, target: float = TARGET_RECALL, num_queries: int = NUM_QUERIES, seed: int = 0
              ) -> ProbeTable:
    """Measure the smallest nprobe reaching `target` recall@k at each filter fraction of FRACTIONS.

    Args:
        index: a trained IVF index holding `labels` (inner product).
        vecs: the rows by label.
        labels: the live labels (the rows the fractions are of).
        min_rows: the ladder stops at the first fraction leaving at most this many readable rows.
        k, target, num_queries: recall@k target and how many calibration queries.
        seed: for the query sample, the noise and the allow-lists (a build is reproducible).

    Returns:
        The table; its fractions are those of the ladder that leave more than k readable rows.
    """
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    m = len(labels)
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
    # Nested random allow-lists: the one of fraction f is the first ceil(f * m) labels of one random
    # order; a label's tier is the smallest of them it belongs to.
    counts = sorted(c for _, c in ladder)
    position = np.empty(m, dtype=np.int64)
    position[rng.permutation(m)] = np.arange(m)
    tier = np.searchsorted(np.asarray(counts), position, side="right")  # of np.sort(labels)[i]
    truth = dict(zip(counts, _exact_truth(queries, source, vecs, np.sort(labels), tier, len(counts), k),
                     strict=True))
    # A filtered IVF search at nprobe p returns the true top k rows that lie in the p lists whose
    # centroids rank first for the query (the selector drops unreadable rows before ranking, and
    # a true top-k row in a probed list is outranked by at most k - 1 readable rows). So the probes
    # a true neighbour needs is its list's rank + 1, and recall(p) for every p is one count.
    rank, owner = list_ranks(index, queries), lists_of(index, len(vecs))

    fractions, nprobes, recalls = [], [], []
    floor = 1
    for f, count in ladder:
        need = np.sort(probes_needed(rank, owner, truth[count]).ravel())
        p = max(floor, int(need[math.ceil(target * len(need)) - 1]))
        floor = p  # a stricter filter never gets fewer probes
        fractions.append(f)
        nprobes.append(p)
        recalls.append(float(np.searchsorted(need, p, side="right") / len(need)))
    return ProbeTable(tuple(fractions), tuple(nprobes), tuple(recalls), k, target, time.perf_counter() - started)


def list_ranks(index: faiss.IndexIVF, queries: np.ndarray) -> np.ndarray:
    """(queries, nlist): where each list comes in each query's probe order (0: probed first)."""
    nlist = int(index.nlist)
    _, order = index.quantizer.search(queries, nlist)  # the order a search probes the lists in
    rank = np.empty_like(order)
    rank[np.arange(len(queries))[:, None], order] = np.arange(nlist)
    return rank


def probes_needed(rank: np.ndarray, owner: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(queries, k): the nprobe from which a filtered search finds each true neighbour (labels `truth`)."""
    return rank[np.arange(len(truth))[:, None], owner[truth]] + 1


def lists_of(index: faiss.IndexIVF, num_rows: int) -> np.ndarray:
    """The inverted list holding each label (-1: none)."""
    owner = np.full(num_rows, -1, dtype=np.int64)
    invlists = index.invlists
    for number in range(index.nlist):
        size = invlists.list_size(number)
        if size:
            owner[faiss.rev_swig_ptr(invlists.get_ids(number), size)] = number
    return owner


def _exact_truth(queries: np.ndarray, source: np.ndarray, vecs: np.ndarray, labels: np.ndarray,
                 tier: np.ndarray, num_tiers: int, k: int) -> list[np.ndarray]:
    """Exact top k (labels, (queries, k)) over the rows of tier <= j, for each j, sources excluded, in one pass.

    `tier` gives each of `labels` (ascending) the first allow-list, smallest first, that holds it: the
    allow-lists nest. The scoring is one matrix product per chunk; of its scores only those above the
    loosest running k-th best (the smallest allow-list's) are looked at again, a few per query once
    the first rows are in, so the selection costs little beside the product.
    """
    nq = len(queries)
    best_s = np.full((num_tiers, nq, k), -np.inf, dtype=np.float32)  # allow-list j: rows of tier <= j
    best_l = np.full((num_tiers, nq, k), -1, dtype=np.int64)
    contiguous = len(labels) == len(vecs)  # every row live (as right after a build): no gather
    start, size = 0, 8192  # a small first chunk sets the thresholds
    while start < len(labels):
        block, block_tier = labels[start:start + size], tier[start:start + size]
        scores = queries @ (vecs[start:start + size] if contiguous else vecs[block]).T  # (queries, rows)
        own = np.flatnonzero((source >= block[0]) & (source <= block[-1]))
        at = np.searchsorted(block, source[own])
        mine = block[np.minimum(at, len(block) - 1)] == source[own]
        scores[own[mine], at[mine]] = -np.inf  # a query's own row is never its answer
        kth = best_s.min(axis=2).T  # (queries, tiers): each allow-list's k-th best so far, rising with j
        qi, ci = np.nonzero(scores > kth[:, :1])
        score, row, row_tier = scores[qi, ci], block[ci], block_tier[ci]
        for j in range(num_tiers):
            keep = (row_tier <= j) & (score > kth[qi, j])
            if keep.any():
                best_s[j], best_l[j] = _merge(best_s[j], best_l[j], qi[keep], score[keep], row[keep], k)
        start += size
        size = CHUNK
    return [best_l[j] for j in range(num_tiers)]


def _merge(best_s: np.ndarray, best_l: np.ndarray, qi: np.ndarray, score: np.ndarray, label: np.ndarray, k: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """Each query's k best of its current ones and the candidates (qi ascending: query of each)."""
    nq = len(best_s)
    counts = np.bincount(qi, minlength=nq)
    slot = np.arange(len(qi)) - (np.cumsum(counts) - counts)[qi]
    wide_s = np.full((nq, k + int(counts.max())), -np.inf, dtype=np.float32)
    wide_l = np.full(wide_s.shape, -1, dtype=np.int64)
    wide_s[:, :k], wide_l[:, :k] = best_s, best_l
    wide_s[qi, k + slot], wide_l[qi, k + slot] = score, label
    top = np.argpartition(-wide_s, k - 1, axis=1)[:, :k]
    return np.take_along_axis(wide_s, top, 1), np.take_along_axis(wide_l, top, 1)
