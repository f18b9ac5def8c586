"""IVF build and ACL-filtered search, GPU beside CPU on the same index: build time, recall@10, p99.

    PYTHONPATH=. .venv/bin/python bench/faiss_gpu.py                 # 10M x 384 (a GPU machine, faiss-gpu)
    PYTHONPATH=. .venv/bin/python bench/faiss_gpu.py --n 200000      # the CPU-only scale-down

Data: N unit vectors (384-d) from a Gaussian mixture (2,000 components, each vector its
component's mean plus noise, cosine to the mean ~0.7), normalized, like sentence embeddings;
queries drawn the same way. Every row belongs to one of 100 groups (independent of the
components); users read 50, 10 or 1 groups (50%, 10%, 1%). Recall@10 is against exact filtered
search (numpy over the readable rows). Both peers are our `GpuIvfIndex`/`IvfIndex` code with
`exact_below=0`, so the lists answer every search: "cpu" is IvfIndex (selector inside the
search), "gpu" the same CPU-built lists copied to the GPU (over-fetch + post-filter, or the
cuVS selector); "stand-in" is the gpu peer's search logic on a CPU replica that has no
selector (what the contract suite tests). Without a GPU the gpu row is absent and the build line says so.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss  # noqa: E402

from retrieval.vectors.faiss_ann import IvfIndex  # noqa: E402
from retrieval.vectors.faiss_gpu import FaissGpu, GpuIvfIndex, SelectorlessCpu, gpu_available  # noqa: E402

GROUPS = 100
SHARES = {"50%": 50, "10%": 10, "1%": 1}


def mixture(rng: np.random.Generator, means: np.ndarray, m: int, batch: int = 1_000_000) -> np.ndarray:
    dim = means.shape[1]
    out = np.empty((m, dim), dtype=np.float32)
    for s in range(0, m, batch):
        e = min(m, s + batch)
        noise = rng.standard_normal((e - s, dim)).astype(np.float32) / np.sqrt(dim)
        v = means[rng.integers(0, len(means), size=e - s)] + noise
        out[s:e] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def timed_searches(store, queries, allowed, k):
    hits, lat = [], []
    for q in queries:
        t = time.perf_counter()
        hits.append(store.search(q, k, allowed))
        lat.append(time.perf_counter() - t)
    return hits, lat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--k", type=int, default=10)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    means = rng.standard_normal((2000, args.dim)).astype(np.float32)
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    t = time.perf_counter()
    vecs = mixture(rng, means, args.n)
    queries = mixture(rng, means, args.queries)
    group = rng.integers(0, GROUPS, size=args.n)
    ids = np.arange(args.n, dtype=np.int64)
    print(f"data: {args.n:,} x {args.dim} in {time.perf_counter() - t:.1f} s")
    has_gpu = gpu_available()
    print(f"{datetime.date.today()} {platform.node()} faiss {faiss.__version__} cpus={faiss.omp_get_max_threads()} "
          f"gpus={faiss.get_num_gpus()}")

    # Build: the CPU k-means + fill, and (with a GPU) the same on the GPU.
    cpu = IvfIndex(args.dim, exact_below=0)
    t = time.perf_counter()
    cpu.add(ids, vecs)
    cpu_build = time.perf_counter() - t
    print(f"build  cpu {cpu_build:8.1f} s  (nlist {cpu.index.nlist})")
    gpu = None
    if has_gpu:
        gpu = GpuIvfIndex(args.dim, FaissGpu(), exact_below=0, min_rows=0)
        t = time.perf_counter()
        gpu.add(ids, vecs)
        gpu_build = time.perf_counter() - t
        print(f"build  gpu {gpu_build:8.1f} s  cpu/gpu {cpu_build / gpu_build:.1f}x")
        # Search both on the same lists: the GPU replica of the CPU-built index.
        gpu.index, gpu.replica = cpu.index, None
    else:
        print("build  gpu      n/a  (this Faiss sees no GPU: only the CPU ran)")

    # The GPU's search logic (over-fetch, deepen, CPU fallback) on a CPU replica without a selector.
    standin = GpuIvfIndex(args.dim, SelectorlessCpu(), exact_below=0, min_rows=0)
    standin.add(ids[:0], vecs[:0])
    standin.index, standin.trained_on = cpu.index, cpu.trained_on
    standin._vecs, standin._ext, standin._live, standin._label_of = cpu._vecs, cpu._ext, cpu._live, cpu._label_of
    print(f"{'share':>5} {'peer':>8} {'recall@10':>9} {'p50 ms':>8} {'p99 ms':>8}  path")
    for name, g in SHARES.items():
        allowed = ids[group < g]
        sub = vecs[allowed]
        exact = []
        for q in queries:
            s = sub @ q
            top = np.argpartition(-s, args.k)[:args.k]
            exact.append(set(allowed[top].tolist()))
        peers = [("cpu", cpu), ("stand-in", standin)] + ([("gpu", gpu)] if gpu is not None else [])
        for peer, store in peers:
            before = {a: getattr(store, a, 0) for a in ("num_gpu_searches", "num_gpu_fallbacks", "num_fallbacks")}
            hits, lat = timed_searches(store, queries, allowed, args.k)
            recall = np.mean([len({i for i, _ in h} & e) / args.k for h, e in zip(hits, exact, strict=True)])
            path = ", ".join(f"{a[4:]}={getattr(store, a, 0) - b}" for a, b in before.items() if hasattr(store, a))
            ms = np.array(lat) * 1e3
            p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
            print(f"{name:>5} {peer:>8} {recall:9.3f} {p50:8.2f} {p99:8.2f}  {path}")


if __name__ == "__main__":
    main()
