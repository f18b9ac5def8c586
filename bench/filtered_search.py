"""ACL-filtered vector search at three selectivities: recall@k and latency per store.

    PYTHONPATH=. .venv/bin/python bench/filtered_search.py            # 100,000 x 384, ~10 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/filtered_search.py --n 20000  # quick look
    PYTHONPATH=. .venv/bin/python bench/filtered_search.py --n 1000000 --stores faiss-ivf,pgvector \
        --pg-maintenance-mem 5GB --pg-shared-buffers 3GB      # 1M: pgvector + Faiss IVF + exact, ~15 min
    PYTHONPATH=. .venv/bin/python bench/filtered_search.py --n 200000 --stores pgvector \
        --pg-m 24 --pg-ef-construction 128 --pg-ef-more 400     # another HNSW graph (m, ef_construction)
    python3 bench/filtered_search.py --n 10000000 --stores faiss-ivf --no-pg --queries 50 \
        --cache /tmp/fs10m                     # 10M on a 16-core machine in one call: make, keep, search
    python3 bench/filtered_search.py --n 10000000 --stores faiss-ivf --no-pg --queries 50 \
        --cache /tmp/fs10m --build-only        # or in two: data + index (~45 GB disk), then again without it

Data: N random unit vectors (384-d), documents of 10 chunks each, every document in one of
100 groups. Users hold 50, 10 and 1 groups (50%, 10%, 1% of the corpus). Each store is
asked for the top k of what the user may read; recall@k is measured against exact filtered
search in numpy, and the exact search itself (a flat Faiss index with the allow-list as an
ID selector) is the latency peer.

Stores (`--stores`), each through our own code; the exact peer always runs:
- faiss-hnsw: the embedded default's catalog (SQLite ACL table -> allow-list) + `HnswIndex`;
  "store only" times the vector search given the allow-list, "with catalog" adds the lookup.
- faiss-ivf: `IvfIndex` alone (store only, ids 1..N; no catalog); the build line prints its probe
  table (measured at training) and each row the nprobe its filter got. Two rows: "one allow-list"
  hands it the user's ids in one array, translated on every query (what a caller without the
  collection's cache pays); "per-group row sets" hands it one row set per group, made once (the
  line before the table says how long that took per group) and unioned per query, as the embedded
  collection does with each ACL token; "the user's union cached" is a repeat asker, whose union
  the collection keeps until the collection changes.
- pgvector: `PgvectorCollection` (HNSW, ACL filter in the WHERE clause, iterative index scan).
- pgvector, no iterative scan: the same SQL with `hnsw.iterative_scan = off`, to show why
  it matters: the index hands back its ef_search nearest rows and the filter then drops most.

Random isotropic vectors are the hard case for graph indexes (real embeddings cluster), so
the search widths here are higher than a sample corpus needs.

Memory stays bounded at 1M: the vectors are drawn in float32 blocks (on all cores), exact
recall is computed over row chunks, pgvector is loaded a batch of documents per transaction
(binary COPY), and the Faiss indexes are freed before PostgreSQL builds its graph.

Each phase prints its wall time on a "# phase" line (data, data save, faiss-ivf build: copy +
ids, k-means, list fill, probe calibration; save; load; the exact peer's copy; the exact truth),
so a run that a time limit cuts short still says where the time went.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag.types import Chunk, Document  # noqa: E402
from retrieval.stores.embedded.catalog import Catalog  # noqa: E402
from retrieval.stores.embedded.collection import EmbeddedCollection  # noqa: E402
from retrieval.vectors.faiss_ann import IvfIndex  # noqa: E402
from retrieval.vectors.faiss_flat import FlatIndex  # noqa: E402
from retrieval.vectors.row_sets import union  # noqa: E402

GROUPS = 100
CHUNKS_PER_DOC = 10
SHARES = {"50%": 50, "10%": 10, "1%": 1}
DATA_BLOCK = 65_536  # rows drawn per task (and per child seed)
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def make_data(n: int, dim: int, seed: int = 0):
    """Unit vectors: isotropic Gaussian, or clustered like sentence embeddings.

    "clustered": `--topics` (1,000) random topic directions, each vector a topic plus Gaussian
    noise of the same norm (cosine to its topic ~0.7), queries drawn the same way. Groups are
    assigned to documents independently of topics, so the ACL filter is uncorrelated with the
    vectors. Within a topic the vectors are isotropic noise, the hard case for a graph: recall
    falls as a topic holds more of them, so a smaller N with fewer topics (200,000 over 200:
    1,000 a topic) stands in for 1M over 1,000 when comparing HNSW graphs.

    Drawn in float32 blocks of DATA_BLOCK rows, each from its own child of one seed, on all cores
    (numpy's generators release the GIL): 10M x 384 is ~4e9 normals, ~100 s on one core. The data
    depend on the seed and N only, never on the number of threads.
    """
    corpus_seed, query_seed, topic_seed, group_seed = np.random.SeedSequence(seed).spawn(4)
    topics = np.random.default_rng(topic_seed).standard_normal((args.topics, dim), dtype=np.float32)
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    scale = np.float32(1 / np.sqrt(dim))

    def fill(out: np.ndarray, block_seed: np.random.SeedSequence) -> None:
        rng = np.random.default_rng(block_seed)
        rng.standard_normal(out.shape, dtype=np.float32, out=out)
        if args.data == "clustered":  # queries come from the same topics as the corpus
            out *= scale
            out += topics[rng.integers(0, len(topics), size=len(out))]
        out /= np.linalg.norm(out, axis=1, keepdims=True)

    def draw(m: int, seq: np.random.SeedSequence) -> np.ndarray:
        v = np.empty((m, dim), dtype=np.float32)
        starts = range(0, m, DATA_BLOCK)
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            list(pool.map(lambda s, b: fill(v[s:s + DATA_BLOCK], b), starts, seq.spawn(len(starts))))
        return v

    vecs = draw(n, corpus_seed)
    doc_group = np.random.default_rng(group_seed).integers(0, GROUPS, size=n // CHUNKS_PER_DOC)
    return vecs, doc_group, draw(args.queries, query_seed)


def cached_data(cache: Path):
    """make_data's arrays, from `cache` when a run with the same data arguments saved them there."""
    import json

    meta = {"n": args.n, "dim": args.dim, "data": args.data, "topics": args.topics, "queries": args.queries}
    files = {name: cache / f"{name}.npy" for name in ("vecs", "doc_group", "queries")}
    if (cache / "data.json").exists() and json.loads((cache / "data.json").read_text()) == meta:
        t = time.perf_counter()
        # The vectors are memory-mapped: the indexes copy what they keep, the exact peer reads row chunks.
        out = (np.load(files["vecs"], mmap_mode="r"), np.load(files["doc_group"]), np.load(files["queries"]))
        print(f"# data read from {cache} in {time.perf_counter() - t:.1f} s", flush=True)
        return out
    out = timed_data()
    t = time.perf_counter()
    cache.mkdir(parents=True, exist_ok=True)
    for name, array in zip(files, out, strict=True):
        np.save(files[name], array)
    (cache / "data.json").write_text(json.dumps(meta))
    print(f"# phase data save: {time.perf_counter() - t:.1f} s ({out[0].nbytes / 1e9:.1f} GB to {cache})", flush=True)
    return out


def timed_data():
    t = time.perf_counter()
    out = make_data(args.n, args.dim)
    print(f"# phase data: {time.perf_counter() - t:.1f} s ({args.n:,} x {args.dim} float32, {THREADS} threads)",
          flush=True)
    return out


def build_ivf(ids: np.ndarray, vecs: np.ndarray) -> IvfIndex:
    t = time.perf_counter()
    ivf = IvfIndex(args.dim)
    ivf.add(ids, vecs)
    built = time.perf_counter() - t
    calibration = f", probe calibration {ivf.probes.seconds:.1f} s of it" if ivf.probes else ""
    print(f"# faiss-ivf built in {built:.0f} s (k-means + fill{calibration}, {ivf.index.nlist} "
          f"lists, exact below {ivf.exact_below:,} readable)", flush=True)
    phases = {"copy + ids": built - sum(ivf.build_seconds.values()), **ivf.build_seconds}
    print("# phase faiss-ivf build: " + ", ".join(f"{name} {s:.1f} s" for name, s in phases.items())
          + f" ({faiss.omp_get_max_threads()} OpenMP threads)", flush=True)
    return ivf


def cached_ivf(cache: Path, ids: np.ndarray, vecs: np.ndarray) -> IvfIndex:
    """The faiss-ivf store from `cache` (saved and loaded through its own save/load, as a collection's
    index file is), else built and saved there."""
    path = cache / "ivf.npz"
    if path.exists():
        t = time.perf_counter()
        ivf = IvfIndex.load(path, args.dim)
        print(f"# phase faiss-ivf load: {time.perf_counter() - t:.1f} s", flush=True)
        print(f"# faiss-ivf loaded from {path} in {time.perf_counter() - t:.0f} s ({path.stat().st_size / 1e9:.1f} GB; "
              f"{(cache / 'ivf.txt').read_text().strip() if (cache / 'ivf.txt').exists() else ''})", flush=True)
        return ivf
    t = time.perf_counter()
    ivf = build_ivf(ids, vecs)
    built = time.perf_counter() - t
    t = time.perf_counter()
    ivf.save(path)
    note = f"built in {built:.0f} s, saved in {time.perf_counter() - t:.0f} s"
    print(f"# phase faiss-ivf save: {time.perf_counter() - t:.1f} s ({path.stat().st_size / 1e9:.1f} GB)", flush=True)
    (cache / "ivf.txt").write_text(note)
    print(f"# faiss-ivf {note} to {path}", flush=True)
    return ivf


def exact_truth(vecs: np.ndarray, chunk_group: np.ndarray, queries: np.ndarray, users: dict[str, list[str]],
                ids: np.ndarray, k: int, chunk: int = 65_536) -> dict[str, list[set[int]]]:
    """Exact filtered top k of every query for every user, over row chunks (no N-row score arrays)."""
    groups = {share: [int(tok.split(":g")[1]) for tok in tokens] for share, tokens in users.items()}
    best = {share: (np.full((len(queries), 0), -np.inf, np.float32), np.empty((len(queries), 0), np.int64))
            for share in users}
    for s in range(0, len(vecs), chunk):
        scores = queries @ vecs[s:s + chunk].T  # (queries, rows)
        for share, gs in groups.items():
            cols = np.flatnonzero(np.isin(chunk_group[s:s + chunk], gs))
            top_s = np.concatenate([best[share][0], scores[:, cols]], axis=1)
            top_i = np.concatenate([best[share][1], np.broadcast_to(ids[s + cols], (len(queries), len(cols)))], axis=1)
            if top_s.shape[1] > k:
                keep = np.argpartition(-top_s, k - 1, axis=1)[:, :k]
                top_s, top_i = np.take_along_axis(top_s, keep, 1), np.take_along_axis(top_i, keep, 1)
            best[share] = (top_s, top_i)
    return {share: [set(row.tolist()) for row in top_i] for share, (_, top_i) in best.items()}


def documents(vecs: np.ndarray, doc_group: np.ndarray):
    for d, g in enumerate(doc_group):
        key = f"doc{d:06d}"
        rows = vecs[d * CHUNKS_PER_DOC:(d + 1) * CHUNKS_PER_DOC]
        doc = Document(key=key, source=f"/bench/{key}", text=key,
                       content_hash=hashlib.sha1(key.encode()).hexdigest(), acl=frozenset({f"group:g{g}"}))
        chunks = [Chunk(document_key=key, index=i, text=f"{key} chunk {i}", num_tokens=3) for i in range(len(rows))]
        yield doc, frozenset({f"group:g{g}"}), chunks, rows


def timed(fn, queries):
    out, lat = [], []
    for q in queries:
        t = time.perf_counter()
        out.append(fn(q))
        lat.append((time.perf_counter() - t) * 1000)
    return out, lat


def timed_paths(store, fn, queries):
    """timed(), also saying for each query which path the HNSW store took (from its counters)."""
    out, lat, paths = [], [], []
    for q in queries:
        before = (store.num_exact_searches, store.num_fallbacks)
        t = time.perf_counter()
        out.append(fn(q))
        lat.append((time.perf_counter() - t) * 1000)
        exact, fallback = store.num_exact_searches - before[0], store.num_fallbacks - before[1]
        paths.append("exact" if exact else "fallback" if fallback else "approximate")
    return out, lat, paths


def path_note(results, truth, paths) -> str:
    """Recall of the queries the graph answered, apart from those answered exactly (selective or fallback)."""
    parts = []
    for path in ("approximate", "fallback", "exact"):
        picked = [(r, t) for r, t, p in zip(results, truth, paths, strict=True) if p == path]
        if picked:
            recall = np.mean([len({i for i, _ in r} & t) / len(t) for r, t in picked])
            parts.append(f"{path} {len(picked)} q, recall {recall:.3f}")
    return "; ".join(parts)


def summary(results, truth, lat, k):
    recall = np.mean([len({i for i, _ in r} & t) / len(t) for r, t in zip(results, truth, strict=True)])
    short = sum(len(r) < min(k, len(t)) for r, t in zip(results, truth, strict=True))
    return recall, statistics.median(lat), float(np.percentile(lat, 99)), short


def main() -> None:
    stores = set(args.stores.split(","))
    if args.no_pg:
        stores.discard("pgvector")
    if unknown := stores - {"faiss-hnsw", "faiss-ivf", "pgvector"}:
        raise SystemExit(f"unknown --stores {sorted(unknown)}: choose from faiss-hnsw, faiss-ivf, pgvector")
    if args.cache and "faiss-hnsw" in stores:
        raise SystemExit("--cache keeps the faiss-ivf index of ids 1..N: leave faiss-hnsw out of --stores")
    if args.build_only and not args.cache:
        raise SystemExit("--build-only needs --cache (where the data and the index are kept)")
    started = time.perf_counter()
    cache = Path(args.cache) if args.cache else None
    vecs, doc_group, queries = cached_data(cache) if cache else timed_data()
    chunk_group = np.repeat(doc_group, CHUNKS_PER_DOC)
    users = {share: [f"group:g{g}" for g in range(n)] for share, n in SHARES.items()}
    data = f"{args.data}, {args.topics} topics" if args.data == "clustered" else args.data
    print(f"# filtered search: {args.n:,} x {args.dim} random unit vectors ({data}), {GROUPS} groups, k={args.k}, "
          f"{args.queries} queries per user; stores: exact, {', '.join(sorted(stores))}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{datetime.date.today().isoformat()}; data in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rag-bench-"))

    # -- the embedded default: catalog + HNSW -------------------------------------------
    index = None
    ids = np.arange(1, args.n + 1, dtype=np.int64)  # store-only ids when no catalog numbers them
    if "faiss-hnsw" in stores:
        t = time.perf_counter()
        catalog = Catalog(work / "catalog.sqlite")
        info = catalog.create_collection("bench", "random", "random", args.dim, {})
        index = EmbeddedCollection(catalog, info, None, "faiss-hnsw")
        index.vectors.ef_search = args.faiss_ef
        for doc, acl, chunks, rows_ in documents(vecs, doc_group):
            index.replace_document(doc, acl, chunks, rows_)
        index.vectors.sync()  # graph inserts are batched until the first search; build it before timing
        print(f"# faiss-hnsw built in {time.perf_counter() - t:.0f} s (catalog writes + graph, M=32, efC=80)",
              flush=True)
        ids, _ = catalog.vectors("bench")  # catalog chunk ids, in insertion order
    ivf = None
    if "faiss-ivf" in stores:
        ivf = cached_ivf(cache, ids, vecs) if cache else build_ivf(ids, vecs)
        if ivf.probes:
            print(f"# faiss-ivf {ivf.probes.describe()}", flush=True)
    if args.build_only:
        print("# --build-only: the data and the index are in the cache; run again without it to search")
        return
    t = time.perf_counter()
    flat = FlatIndex(args.dim)
    flat.add(ids, vecs)
    print(f"# phase exact peer (flat index) copy: {time.perf_counter() - t:.1f} s", flush=True)

    group_rows: dict = {}  # ACL token -> the IVF index's row set, made on first use
    t = time.perf_counter()
    truth = exact_truth(vecs, chunk_group, queries, users, ids, args.k)
    print(f"# phase exact truth: exact filtered top {args.k} (numpy, in row chunks) in {time.perf_counter() - t:.1f} s",
          flush=True)
    for share, tokens in users.items():
        allowed = ids[np.isin(chunk_group, [int(tok.split(":g")[1]) for tok in tokens])]
        # exact peer: flat Faiss with the allow-list as an ID selector
        res, lat = timed(lambda q, a=allowed: flat.search(q, args.k, a), queries)
        exact = summary(res, truth[share], lat, args.k)
        rows.append(("exact (faiss flat + selector)", share, *exact))
        if ivf is not None:
            res, lat, paths = timed_paths(ivf, lambda q, a=allowed: ivf.search(q, args.k, a), queries)
            probes = (f"nprobe {ivf._nprobe(ivf.count() / len(allowed), args.k)} of {ivf.index.nlist}, "
                      if len(allowed) > ivf.exact_below else "")
            rows.append((f"faiss-ivf, one allow-list ({probes}{path_note(res, truth[share], paths)})", share,
                         *summary(res, truth[share], lat, args.k), exact[1]))
            t = time.perf_counter()
            parts = [group_rows.setdefault(tok, ivf.rows_for(ids[chunk_group == int(tok.split(":g")[1])]))
                     for tok in tokens]
            print(f"# {share}: faiss-ivf row sets of {len(tokens)} groups in {time.perf_counter() - t:.2f} s "
                  f"(once per change of the collection)", flush=True)
            res, lat, paths = timed_paths(ivf, lambda q, p=parts: ivf.search_rows(q, args.k, p), queries)
            rows.append((f"faiss-ivf, per-group row sets ({path_note(res, truth[share], paths)})", share,
                         *summary(res, truth[share], lat, args.k), exact[1]))
            if len(parts) > 1:
                cached = [union(parts, ivf.generation, parts[0].n)]
                res, lat, paths = timed_paths(ivf, lambda q, p=cached: ivf.search_rows(q, args.k, p), queries)
                rows.append((f"faiss-ivf, the user's union cached ({path_note(res, truth[share], paths)})", share,
                             *summary(res, truth[share], lat, args.k), exact[1]))
        if index is not None:
            store = index.vectors
            res, lat, paths = timed_paths(store, lambda q, a=allowed, s=store: s.search(q, args.k, a), queries)
            rows.append((f"faiss-hnsw, store only ({path_note(res, truth[share], paths)})", share,
                         *summary(res, truth[share], lat, args.k), exact[1]))
            res, lat, paths = timed_paths(store, lambda q, tk=tokens: index.search(q, args.k, tk), queries)
            rows.append((f"faiss-hnsw, with catalog ACL ({path_note(res, truth[share], paths)})", share,
                         *summary(res, truth[share], lat, args.k), exact[1]))
        print(f"# {share}: faiss rows done", flush=True)

    # -- pgvector ---------------------------------------------------------------------
    try:
        if "pgvector" in stores:
            # Free the Faiss copies of the vectors first: PostgreSQL's graph build wants the memory.
            del flat, ivf, index
            gc.collect()
            pg_rows(vecs, doc_group, queries, users, truth, ids, work, rows)
    finally:  # a failure late in a long run still prints the rows measured so far
        print_table(rows, started)


def print_table(rows, started: float) -> None:
    print()
    print(f"| store | user reads | recall@{args.k} | p50 ms | p99 ms | queries with < k hits | p50 vs exact |")
    print("|---|---|---|---|---|---|---|")
    for name, share, recall, p50, p99, short, *peer in rows:
        ratio = f"{p50 / peer[0]:.2f}x" if peer else "1.00x"
        print(f"| {name} | {share} | {recall:.3f} | {p50:.2f} | {p99:.2f} | {short} | {ratio} |")
    print(f"# total {time.perf_counter() - started:.0f} s")


def pg_rows(vecs, doc_group, queries, users, truth, ids, work, rows) -> None:
    import psycopg

    from rag.local_postgres.server import LocalPostgres
    from retrieval.stores.pgvector.collection import chunk_id, create_collection, open_collection
    from retrieval.stores.pgvector.schema import hnsw_index_name

    server = None
    dsn = args.dsn
    if dsn is None:
        server = LocalPostgres(work / "postgres", server_options={
            "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
            "maintenance_work_mem": args.pg_maintenance_mem, "shared_buffers": args.pg_shared_buffers,
            "max_parallel_maintenance_workers": "2"})
        dsn = server.start()
    try:
        # A batch of documents per transaction (binary COPY of the chunks), as ingest writes.
        tuning = {"max_scan_tuples": args.pg_max_scan}
        if args.pg_exact_below is not None:
            tuning["exact_below"] = args.pg_exact_below
        # The graph parameters go to the store, whose CREATE INDEX (read back below) carries them.
        graph = {k: v for k, v in (("hnsw_m", args.pg_m), ("hnsw_ef_construction", args.pg_ef_construction))
                 if v is not None}
        coll = create_collection(dsn, "bench", "random", "random", args.dim, {}, ef_search=args.pg_ef,
                                 batch_documents=args.pg_batch, **graph, **tuning)
        t = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            name = hnsw_index_name("bench")
            indexdef = conn.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", (name,)).fetchone()[0]
            conn.execute(f'DROP INDEX "{name}"')  # bulk load first, then build the graph once
            for doc, acl, chunks, rows_ in documents(vecs, doc_group):
                coll.replace_document(doc, acl, chunks, rows_)
            coll.flush()
            loaded = time.perf_counter()
            print(f"# pgvector loaded in {loaded - t:.0f} s ({args.pg_batch} documents per transaction); "
                  f"building HNSW (maintenance_work_mem {args.pg_maintenance_mem})", flush=True)
            # pgvector says (a NOTICE) when the graph outgrows maintenance_work_mem and the build slows.
            conn.add_notice_handler(lambda d: print(f"# postgres notice: {d.message_primary}", flush=True))
            conn.execute(indexdef)
            conn.execute("ANALYZE rag_chunks")
            size = conn.execute("SELECT pg_size_pretty(pg_relation_size(%s::regclass)), "
                                "pg_size_pretty(pg_table_size('rag_chunks'))", (name,)).fetchone()
        print(f"# pgvector loaded in {loaded - t:.0f} s, HNSW (m {coll.hnsw.m}, ef_construction "
              f"{coll.hnsw.ef_construction}) built in {time.perf_counter() - loaded:.0f} s "
              f"(index {size[0]}, table {size[1]}; ef_search {args.pg_ef}, max_scan_tuples {args.pg_max_scan}, "
              f"exact below {coll.exact_below:,} readable)",
              flush=True)
        # our catalog ids -> pgvector ids (deterministic per document key and chunk index)
        pg_id = {int(i): chunk_id("bench", f"doc{n // CHUNKS_PER_DOC:06d}", n % CHUNKS_PER_DOC)
                 for n, i in enumerate(ids)}
        exact_p50 = {r[1]: r[3] for r in rows if r[0].startswith("exact")}
        for share, tokens in users.items():
            pg_truth = [{pg_id[i] for i in t} for t in truth[share]]
            coll.num_fallbacks = 0
            res, lat = timed(lambda q, tk=tokens: coll.search(q, args.k, tk), queries)
            rows.append((f"pgvector HNSW, iterative scan ({coll.num_fallbacks} exact fallbacks)", share,
                         *summary(res, pg_truth, lat, args.k), exact_p50[share]))
            with psycopg.connect(dsn, autocommit=True) as conn:
                from pgvector.psycopg import register_vector

                register_vector(conn)
                conn.execute("SET hnsw.iterative_scan = off")
                conn.execute(f"SET hnsw.ef_search = {args.pg_ef}")
                statement = coll._sql_approx.as_string(conn)
                res, lat = timed(lambda q, tk=tokens, c=conn, s=statement: c.execute(
                    s, {"q": q, "tokens": tk, "k": args.k}).fetchall(), queries)
            rows.append(("pgvector HNSW, no iterative scan", share, *summary(res, pg_truth, lat, args.k),
                         exact_p50[share]))
            print(f"# {share}: pgvector rows done", flush=True)
        coll.close()
        # Wider searches of the same graph, through the store (iterative scan): what recall costs.
        for ef in (int(v) for v in args.pg_ef_more.split(",") if v):
            wide = open_collection(dsn, "bench", ef_search=ef, **tuning)
            for share, tokens in users.items():
                pg_truth = [{pg_id[i] for i in t} for t in truth[share]]
                res, lat = timed(lambda q, tk=tokens, c=wide: c.search(q, args.k, tk), queries)
                rows.append((f"pgvector HNSW, iterative scan, ef_search {ef} ({wide.num_fallbacks} exact fallbacks)",
                             share, *summary(res, pg_truth, lat, args.k), exact_p50[share]))
                wide.num_fallbacks = 0
            wide.close()
            print(f"# ef_search {ef}: pgvector rows done", flush=True)
    finally:
        if server is not None:
            server.destroy()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--data", choices=["clustered", "isotropic"], default="clustered",
                        help="isotropic Gaussian vectors are the worst case for graph indexes")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--topics", type=int, default=1000,
                        help="topic directions of the clustered data (vectors a topic: N / topics)")
    parser.add_argument("--faiss-ef", type=int, default=128, help="HnswIndex base efSearch (widened by selectivity)")
    parser.add_argument("--pg-ef", type=int, default=100, help="pgvector hnsw.ef_search")
    parser.add_argument("--pg-ef-more", default="",
                        help="comma list of further hnsw.ef_search values, measured with the iterative scan")
    parser.add_argument("--pg-max-scan", type=int, default=20_000, help="pgvector hnsw.max_scan_tuples")
    parser.add_argument("--pg-m", type=int, help="pgvector HNSW m (default: the store's, as the pg_hnsw_m setting)")
    parser.add_argument("--pg-ef-construction", type=int,
                        help="pgvector HNSW ef_construction (default: the store's, as pg_hnsw_ef_construction)")
    parser.add_argument("--pg-exact-below", type=int,
                        help="pgvector: principals who may read at most this many chunks are searched exactly "
                             "(default: the store's)")
    parser.add_argument("--dsn", help="an existing PostgreSQL with pgvector (default: a throwaway local one)")
    parser.add_argument("--stores", default="faiss-hnsw,pgvector",
                        help="comma list of faiss-hnsw, faiss-ivf, pgvector (the exact peer always runs)")
    parser.add_argument("--no-pg", action="store_true", help="Faiss only (drops pgvector from --stores)")
    parser.add_argument("--cache", help="a folder that keeps the data and the faiss-ivf index between runs, so a "
                                        "10M run fits two calls of a time-limited machine: --build-only, then again")
    parser.add_argument("--build-only", action="store_true",
                        help="make (or read) the data and build (or read) faiss-ivf, then stop before searching")
    parser.add_argument("--pg-batch", type=int, default=256, help="pgvector documents per write transaction")
    parser.add_argument("--pg-maintenance-mem", default="2GB",
                        help="the throwaway server's maintenance_work_mem (the HNSW build; keep the graph in it)")
    parser.add_argument("--pg-shared-buffers", default="1GB", help="the throwaway server's shared_buffers")
    args = parser.parse_args()
    main()
