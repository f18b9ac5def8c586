"""pgvector HNSW build time by graph (m, ef_construction), against m 16 / ef_construction 64 in the same run.

    PYTHONPATH=. .venv/bin/python bench/pgvector_graph_build.py --n 200000 --graphs 16:64,16:96,16:128 --rounds 2

One throwaway PostgreSQL (as bench/filtered_search.py starts it: maintenance_work_mem large
enough for the graph, 2 parallel maintenance workers) and one table of N clustered unit vectors
(1,000 topics, as filtered_search's default data); each graph's index is built and dropped in
turn, round after round (the order interleaved, so a machine shared with other work slows every
graph alike), and the table prints each graph's median build time and its ratio to the 16:64
peer of the same run. Only the build is timed: no load, no keyword index (bench/pgvector_writes.py
times a whole bulk load, the filtered-search bench the recall each graph gives).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe_machine  # noqa: E402

PEER = (16, 64)  # pgvector's own defaults, the store's until 2026-12-07


def vectors(n: int, dim: int, topics: int, seed: int = 0, batch: int = 100_000):
    """Batches of unit vectors, each a random topic direction plus Gaussian noise of the same norm."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    for s in range(0, n, batch):
        m = min(batch, n - s)
        v = centres[rng.integers(0, topics, size=m)] + rng.standard_normal((m, dim)).astype(np.float32) / np.sqrt(dim)
        yield v / np.linalg.norm(v, axis=1, keepdims=True)


def main(args: argparse.Namespace) -> None:
    import psycopg
    from pgvector.psycopg import register_vector

    from rag.local_postgres.server import LocalPostgres
    from retrieval.stores.pgvector.schema import HnswParams

    graphs = [tuple(int(v) for v in g.split(":")) for g in args.graphs.split(",")]
    if PEER not in graphs:
        graphs.insert(0, PEER)
    for m, ef in graphs:
        HnswParams(m, ef)  # pgvector's bounds, before anything is loaded
    print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}, {describe_machine(use_gpu=False)}")
    with tempfile.TemporaryDirectory(prefix="pgvector-graphs-") as tmp:
        server = LocalPostgres(Path(tmp) / "postgres", server_options={
            "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
            "maintenance_work_mem": args.maintenance_mem, "max_parallel_maintenance_workers": str(args.workers)})
        dsn = server.start()
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                register_vector(conn)
                conn.execute(f"CREATE TABLE t (id int8, v vector({args.dim}))")
                t = time.perf_counter()
                with conn.cursor() as cur, cur.copy("COPY t (id, v) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(["int8", "vector"])
                    i = 0
                    for batch in vectors(args.n, args.dim, args.topics):
                        for row in batch:
                            copy.write_row((i, row))
                            i += 1
                conn.execute("VACUUM ANALYZE t")
                version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()[0]
                print(f"# {args.n:,} x {args.dim} clustered unit vectors ({args.topics} topics) loaded in "
                      f"{time.perf_counter() - t:.0f} s; pgvector {version}, maintenance_work_mem "
                      f"{args.maintenance_mem}, {args.workers} parallel workers", flush=True)
                conn.add_notice_handler(lambda d: print(f"# postgres notice: {d.message_primary}", flush=True))
                seconds: dict[tuple[int, int], list[float]] = {g: [] for g in graphs}
                for r in range(args.rounds):
                    for m, ef in graphs if r % 2 == 0 else graphs[::-1]:
                        t = time.perf_counter()
                        conn.execute(f"CREATE INDEX t_hnsw ON t USING hnsw (v vector_ip_ops)"
                                     f" WITH (m = {m}, ef_construction = {ef})")
                        seconds[(m, ef)].append(time.perf_counter() - t)
                        size = conn.execute("SELECT pg_relation_size('t_hnsw')").fetchone()[0]
                        conn.execute("DROP INDEX t_hnsw")
                        print(f"# round {r + 1}: m {m}, ef_construction {ef}: {seconds[(m, ef)][-1]:.1f} s, "
                              f"index {size / 2**20:,.0f} MB", flush=True)
        finally:
            server.destroy()
    peer = statistics.median(seconds[PEER])
    print()
    print("| m | ef_construction | build s (median) | each round s | µs a vector | vs m 16 / ef_construction 64 |")
    print("|---|---|---|---|---|---|")
    for (m, ef), runs in seconds.items():
        median = statistics.median(runs)
        print(f"| {m} | {ef} | {median:.1f} | {' / '.join(f'{s:.1f}' for s in runs)} | "
              f"{median / args.n * 1e6:,.0f} | {median / peer:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--graphs", default="16:64,16:96,16:128", help="comma list of m:ef_construction")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--maintenance-mem", default="2GB", help="the server's maintenance_work_mem (fit the graph)")
    parser.add_argument("--workers", type=int, default=2, help="max_parallel_maintenance_workers")
    main(parser.parse_args())
