"""IVF list count under an ACL filter: build and probe-calibration cost, filtered recall and latency per nlist.

    PYTHONPATH=. .venv/bin/python bench/ivf_lists.py --n 1000000 --nlists 1000,2000,4000
    PYTHONPATH=. .venv/bin/python bench/ivf_lists.py --n 1000000 --topics 100 --floor 1

Each nlist builds an `IvfIndex` (k-means, fill, the probe table of retrieval/vectors/ivf_probes.py)
over the same rows; then every query is searched through the store, one at a time, under a random
allow-list of each fraction (uncorrelated with the vectors), with the nprobe the table gives (never
below `--floor`), and with `--old-rule` also with the rule that preceded the table. Recall@k is
against exact search over the same readable rows; the peer is the store's own exact path over them
(numpy), timed in the same run.

Data: unit vectors, clustered (a topic direction plus Gaussian noise of the same norm, cosine ~0.7;
queries drawn the same way, never stored rows) or isotropic (no structure: IVF's worst case).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.vectors.faiss_ann import IvfIndex  # noqa: E402


def make_data(n: int, queries: int, dim: int, topics: int, isotropic: bool, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((topics, dim)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)

    def draw(m: int, batch: int = 100_000) -> np.ndarray:
        v = np.empty((m, dim), dtype=np.float32)
        for s in range(0, m, batch):
            block = rng.standard_normal((min(batch, m - s), dim)).astype(np.float32)
            if not isotropic:
                block = centers[rng.integers(0, topics, size=len(block))] + block / np.float32(math.sqrt(dim))
            v[s:s + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
        return v

    return draw(n), draw(queries)


class FixedLists(IvfIndex):
    """IvfIndex with a chosen number of lists instead of its rule."""

    def __init__(self, dim: int, nlist: int, nprobe: int) -> None:
        self.fixed_nlist = nlist
        super().__init__(dim, nprobe=nprobe)

    def _new_index(self, n: int) -> faiss.Index:
        nlist = self.fixed_nlist if n else 1
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)


def main() -> None:
    started = time.perf_counter()
    vecs, queries = make_data(args.n, args.queries, args.dim, args.topics, args.data == "isotropic")
    ids = np.arange(1, args.n + 1, dtype=np.int64)
    fractions = [float(f) for f in args.fractions.split(",")]
    rng = np.random.default_rng(1)
    allowed = {f: np.sort(rng.choice(ids, size=int(f * args.n), replace=False)) for f in fractions}
    truth = {}
    for f, a in allowed.items():
        scores = queries @ vecs[a - 1].T
        truth[f] = [set(a[np.argpartition(-row, args.k - 1)[:args.k]].tolist()) for row in scores]
    data = args.data if args.data == "isotropic" else f"clustered, {args.topics} topics"
    print(f"# IVF lists: {args.n:,} x {args.dim} ({data}), k={args.k}, {args.queries} queries, "
          f"nprobe floor {args.floor}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{datetime.date.today().isoformat()}; data + truth in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for nlist in (int(v) for v in args.nlists.split(",")):
        store = FixedLists(args.dim, nlist, args.floor)
        t = time.perf_counter()
        store.add(ids, vecs)
        build = time.perf_counter() - t
        print(f"# nlist {nlist}: built in {build:.1f} s (calibration {store.probes.seconds:.1f} s of it); "
              f"{store.probes.describe()}", flush=True)
        table = store.probes
        for f in fractions:
            exact_lat = []
            for q in queries[:args.exact_queries]:
                t = time.perf_counter()
                store.search(q, args.k, allowed[f], exact=True)
                exact_lat.append((time.perf_counter() - t) * 1000)
            for policy in ("table", "old rule") if args.old_rule else ("table",):
                store.probes = table if policy == "table" else None  # None: the rule of files without a table
                got, lat = [], []
                for q in queries:
                    t = time.perf_counter()
                    got.append(store.search(q, args.k, allowed[f]))
                    lat.append((time.perf_counter() - t) * 1000)
                recall = np.mean([len({i for i, _ in g} & t) / args.k for g, t in zip(got, truth[f], strict=True)])
                rows.append((f"{nlist}{'' if policy == 'table' else ', old rule'}", build, table.seconds, f,
                             store._nprobe(1 / f, args.k) if len(allowed[f]) > store.exact_below else "exact",
                             recall, statistics.median(lat),
                             float(np.percentile(lat, 99)), statistics.median(exact_lat)))
        del store
    print()
    print("| nlist | build s | calibration s | readable | nprobe | recall@10 | p50 ms | p99 ms | exact p50 ms "
          "| p50 vs exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for nlist, build, cal, f, nprobe, recall, p50, p99, exact in rows:
        print(f"| {nlist} | {build:.1f} | {cal:.1f} | {f:.0%} | {nprobe} | {recall:.3f} | {p50:.2f} | {p99:.2f} | "
              f"{exact:.2f} | {p50 / exact:.2f}x |")
    print(f"# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--data", choices=["clustered", "isotropic"], default="clustered")
    parser.add_argument("--topics", type=int, default=1000, help="topic directions of the clustered data")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--exact-queries", type=int, default=50, help="queries timed on the exact path (the peer)")
    parser.add_argument("--nlists", default="447,894,1788", help="comma list of list counts")
    parser.add_argument("--fractions", default="0.5,0.1,0.02", help="readable fractions (random allow-lists)")
    parser.add_argument("--floor", type=int, default=32, help="IvfIndex nprobe (the floor under the table)")
    parser.add_argument("--old-rule", action="store_true",
                        help="also search with the rule of files without a table (a third of the lists, "
                             "times sqrt(1 / fraction)), on the same index")
    args = parser.parse_args()
    main()
