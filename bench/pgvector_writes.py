"""The write stage alone: documents/s and chunks/s into pgvector, per document (before) and in bulk (after).

    PYTHONPATH=. .venv/bin/python bench/pgvector_writes.py                    # 20,000 x 8 x 384-d
    PYTHONPATH=. .venv/bin/python bench/pgvector_writes.py --docs 400 --before-docs 100 --tasks 2  # smoke

Vectors are precomputed (random unit vectors), so embedding is out of the figure: each row
times `replace_document` calls for already-chunked, already-embedded documents, and the
`save()` (and for pgvector bulk, the keyword and HNSW index builds) that ends an ingest. Documents: `--chunks`
chunks of `--words` words each (English stop words and synthetic words drawn by Zipf's law,
so the keyword index has about the work of real text: ~100 distinct lexemes a chunk), a
heading, and one of 20 group ACLs.

Rows, all measured in this run, on one throwaway PostgreSQL started like `rag db start`
(its default settings, durable; ingest's sessions commit new documents asynchronously):
- pgvector, per document (before): a collection created with its HNSW index, one transaction
  per document (`batch_documents=1`), the write path before bulk writes. It runs on the first
  `--before-docs` documents only (it is slow), into an empty collection: its graph stays
  smaller than the others', which flatters it.
- pgvector, bulk (after): what an ingest opens for a new collection (`open_for_ingest`):
  `--batch` documents per transaction, no keyword or HNSW index until `save()` builds them
  (the HNSW graph with the store's default m / ef_construction, or `--pg-m` / `--pg-ef-construction`).
- pgvector, bulk with another graph (`--peer-graph M:EF`): the same load, its HNSW index built
  with m M and ef_construction EF, to weigh a graph's build time in the same run.
- Faiss + SQLite: the embedded default (`faiss` flat index, SQLite catalog with FTS5).
- pgvector bulk, N tasks: N processes (a Slurm array's tasks) each writing 1/N of the corpus
  into one new collection at once; the wall time runs until the last one's `save()` returned
  (the last loader builds the indexes).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe_machine  # noqa: E402
from rag.types import Chunk, Document  # noqa: E402
from retrieval.records import BuildSpec  # noqa: E402

CHUNKING = {"max_tokens": 256, "overlap_tokens": 0}
VOCABULARY = 20_000


STOPWORDS = ("the of and to a in is that for it as was with be by on not he this are or his from at which but "
             "have an they you were her she there been one all we their has would when if so no more").split()


def vocabulary() -> tuple[list[str], np.ndarray]:
    """Words and their probabilities: Zipf's law (p ~ 1/rank), English stop words most frequent."""
    rng = np.random.default_rng(12345)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    made = ["".join(rng.choice(letters, size=int(rng.integers(3, 11)))) for _ in range(VOCABULARY - len(STOPWORDS))]
    p = 1.0 / np.arange(1, VOCABULARY + 1)
    return STOPWORDS + made, p / p.sum()


def document(d: int, words: tuple[list[str], np.ndarray], chunks: int, num_words: int, dim: int
             ) -> tuple[Document, frozenset[str], list[Chunk], np.ndarray]:
    """Document number `d`: the same on every call and in every process."""
    rng = np.random.default_rng(d)
    key = f"lab/doc{d:06d}.md"
    vocab, p = words
    picks = rng.choice(len(vocab), size=(chunks, num_words), p=p)
    texts = [" ".join(vocab[i] for i in row) for row in picks]
    vectors = rng.standard_normal((chunks, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    acl = frozenset({f"group:g{d % 20}"})
    doc = Document(key=key, source=f"/lab/{key}", text="", content_hash=f"h{d}", acl=acl, title=f"Document {d}")
    parts = [Chunk(document_key=key, index=i, text=t, num_tokens=num_words, heading=f"Document {d} › part {i}")
             for i, t in enumerate(texts)]
    return doc, acl, parts, vectors


def documents(numbers: range, args: argparse.Namespace) -> list:
    words = vocabulary()
    return [document(d, words, args.chunks, args.words, args.dim) for d in numbers]


def spec(args: argparse.Namespace) -> BuildSpec:
    return BuildSpec("bench-random-vectors", "bench-random-vectors", args.dim, CHUNKING)


def timed_writes(store, docs: list) -> tuple[float, float]:
    """(seconds writing, seconds in save()) for `docs` into `store`."""
    started = time.perf_counter()
    for doc, acl, chunks, vectors in docs:
        store.replace_document(doc, acl, chunks, vectors)
    written = time.perf_counter()
    store.save()
    return written - started, time.perf_counter() - written


def graph(args: argparse.Namespace) -> dict[str, int]:
    """The HNSW graph parameters asked for (none: the store's defaults)."""
    return {k: v for k, v in (("hnsw_m", args.pg_m), ("hnsw_ef_construction", args.pg_ef_construction))
            if v is not None}


def pg_before(dsn: str, docs: list, args: argparse.Namespace) -> tuple[float, float]:
    from retrieval.stores.pgvector.collection import create_collection

    store = create_collection(dsn, "before", "bench-random-vectors", "bench-random-vectors", args.dim, CHUNKING,
                              batch_documents=1, **graph(args))
    try:
        return timed_writes(store, docs)
    finally:
        store.close()


def pg_bulk(dsn: str, name: str, docs: list, args: argparse.Namespace,
            hnsw: dict[str, int] | None = None) -> tuple[float, float]:
    from retrieval.stores.pgvector.rebuild import open_for_ingest

    store = open_for_ingest(dsn, name, spec(args), batch_documents=args.batch,
                            **(graph(args) if hnsw is None else hnsw))
    try:
        return timed_writes(store, docs)
    finally:
        store.close()


def embedded(work: Path, docs: list, args: argparse.Namespace) -> tuple[float, float]:
    from retrieval.stores.embedded.catalog import Catalog
    from retrieval.stores.embedded.collection import EmbeddedCollection

    catalog = Catalog(work / "catalog.sqlite")
    info = catalog.create_collection("bench", "bench-random-vectors", "bench-random-vectors", args.dim, CHUNKING)
    store = EmbeddedCollection(catalog, info, work / "indexes", "faiss")
    try:
        return timed_writes(store, docs)
    finally:
        catalog.close()


def _task(dsn: str, numbers: range, args: argparse.Namespace, barrier, results) -> None:
    docs = documents(numbers, args)
    barrier.wait()
    load, build = pg_bulk(dsn, "tasks", docs, args)
    results.put((load, build, time.time()))


def pg_tasks(dsn: str, args: argparse.Namespace) -> float:
    """Wall seconds for `args.tasks` processes to write the corpus into one new collection."""
    from retrieval.stores.pgvector.schema import ensure_collection, migrate

    migrate(dsn)
    # Created up front as an ingest would (open_for_ingest: no index), so the tasks race on writes only.
    ensure_collection(dsn, "tasks", spec(args).embedder, spec(args).fingerprint, args.dim, CHUNKING,
                      build_index=False)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(args.tasks + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_task, args=(dsn, range(t, args.docs, args.tasks), args, barrier, results))
             for t in range(args.tasks)]
    for p in procs:
        p.start()
    barrier.wait()
    started = time.time()
    ends = [results.get()[2] for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0, p.exitcode
    return max(ends) - started


def graph_label(args: argparse.Namespace) -> str:
    """The graph the bulk rows build ("m M, ef_construction EF"), as the store resolves it."""
    from retrieval.stores.pgvector.collection import hnsw_params

    hnsw = hnsw_params(**graph(args))
    return f"m {hnsw.m}, ef_construction {hnsw.ef_construction}"


def check_same_rows(dsn: str, a: str, b: str) -> None:
    """Two collections written the two ways hold the same documents, chunks, ACLs and vectors, and both indexes."""
    import psycopg

    from retrieval.stores.pgvector.schema import keyword_index_exists

    query = ("SELECT c.document_key, c.idx, c.text, c.heading, c.acl, c.embedding::text, d.content_hash"
             " FROM rag_chunks c JOIN rag_documents d ON d.collection = c.collection AND d.key = c.document_key"
             ' WHERE c.collection = %s ORDER BY c.document_key COLLATE "C", c.idx')
    with psycopg.connect(dsn) as conn:
        assert conn.execute(query, (a,)).fetchall() == conn.execute(query, (b,)).fetchall(), (a, b)
        for name in (a, b):
            index = conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'rag_chunks'"
                                 " AND indexdef LIKE %s", (f"%hnsw%{name}%",)).fetchone()[0]
            assert index == 1, f"{name} has no HNSW index"
            assert keyword_index_exists(conn, name), f"{name} has no keyword index"


def main(args: argparse.Namespace) -> None:
    from rag.local_postgres.server import LocalPostgres

    print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}, {describe_machine(use_gpu=False)}")
    print(f"# {args.docs} documents x {args.chunks} chunks x {args.dim}-d, {args.words} words a chunk, "
          f"batch {args.batch} documents")
    with tempfile.TemporaryDirectory(prefix="pgvector-writes-") as tmp:
        work = Path(tmp)
        server = LocalPostgres(work / "postgres")
        dsn = server.start()
        try:
            with __import__("psycopg").connect(dsn) as conn:
                version = conn.execute("SELECT version()").fetchone()[0].split(" on ")[0]
                pgv = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()[0]
            print(f"# {version}, pgvector {pgv}, settings as `rag db start`")
            t = time.perf_counter()
            corpus = documents(range(args.docs), args)
            print(f"# corpus generated in {time.perf_counter() - t:.0f} s")
            rows = []
            before = corpus[:args.before_docs]
            load, build = pg_before(dsn, before, args)
            rows.append(("pgvector, per document (before)", len(before), load, build))
            label = graph_label(args)
            load, build = pg_bulk(dsn, "bulk", corpus, args)
            rows.append((f"pgvector, bulk {args.batch}/transaction + indexes after (after; HNSW {label})",
                         len(corpus), load, build))
            if args.peer_graph:
                m, ef = (int(v) for v in args.peer_graph.split(":"))
                load, build = pg_bulk(dsn, "bulk-peer", corpus, args, {"hnsw_m": m, "hnsw_ef_construction": ef})
                rows.append((f"pgvector, bulk {args.batch}/transaction + indexes after (HNSW m {m}, "
                             f"ef_construction {ef})", len(corpus), load, build))
            if args.check:
                pg_bulk(dsn, "bulk-check", before, args)
                check_same_rows(dsn, "bulk-check", "before")
            load, build = embedded(work, corpus, args)
            rows.append(("Faiss + SQLite (embedded default)", len(corpus), load, build))
            del corpus
            wall = pg_tasks(dsn, args) if args.tasks > 1 else None
        finally:
            server.destroy()

    print()
    print("| store | documents | write s | save/index s | documents/s | chunks/s | vs pgvector before |")
    print("|---|---|---|---|---|---|---|")
    base = rows[0][1] / (rows[0][2] + rows[0][3])
    for name, n, load, build in rows:
        rate = n / (load + build)
        print(f"| {name} | {n:,} | {load:.1f} | {build:.1f} | {rate:,.0f} | {rate * args.chunks:,.0f} "
              f"| {rate / base:.1f}x |")
    if wall is not None:
        one = rows[1][2] + rows[1][3]
        rate = args.docs / wall
        print(f"| pgvector bulk, {args.tasks} tasks at once (one collection) | {args.docs:,} | {wall:.1f} (wall) | - "
              f"| {rate:,.0f} | {rate * args.chunks:,.0f} | {rate / base:.1f}x |")
        print(f"\n# {args.tasks} concurrent tasks: {wall:.1f} s wall against {one:.1f} s for one task "
              f"({one / wall:.2f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=8, help="chunks a document")
    parser.add_argument("--words", type=int, default=180, help="words a chunk (~256 tokens)")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--batch", type=int, default=256, help="documents a transaction (bulk)")
    parser.add_argument("--before-docs", type=int, default=2_000, help="documents the per-document path writes")
    parser.add_argument("--tasks", type=int, default=8, help="concurrent writer processes (1: skip)")
    parser.add_argument("--check", action="store_true", help="also check bulk rows equal per-document rows")
    parser.add_argument("--pg-m", type=int, help="HNSW m of every pgvector row (default: the store's)")
    parser.add_argument("--pg-ef-construction", type=int, help="HNSW ef_construction (default: the store's)")
    parser.add_argument("--peer-graph", metavar="M:EF",
                        help="also time the bulk load with its HNSW index built with m M, ef_construction EF")
    main(parser.parse_args())
