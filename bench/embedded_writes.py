"""The write stage alone into the embedded store (SQLite catalog + Faiss): a transaction per document
(before) against one per embed batch of documents (after), documents/s.

    PYTHONPATH=. .venv/bin/python bench/embedded_writes.py                       # 50,000 x 1 chunk
    PYTHONPATH=. .venv/bin/python bench/embedded_writes.py --docs 2000 --rounds 1  # smoke

Vectors are precomputed (random unit vectors, `bench/pgvector_writes.py`'s documents: Zipf words,
one of 20 group ACLs), so embedding and chunking are out of the figure: each row times the
`replace_document` calls an ingest makes, the `flush()` that `ingest.batch_commit` makes after
every embed batch, and the `save()` that ends the run. Defaults match the H200 `rag ingest` run:
50,000 one-chunk documents of ~100 words, 384-d. Rows, each into a fresh catalog, in turn:
- `--batch 1`: flush after every document, i.e. one transaction per document (the path before
  batched catalog writes; the same code as the others, measured in this run).
- `--batch N`: flush after every N documents, as ingest does after an embed batch of N one-chunk
  documents (256 on a CPU, 4096 on a GPU by default).
- `--grouped`: each `--batch N` > 1 also in one `replace_documents` call a batch (ids assigned
  under the write lock, a few `executemany` statements for all rows: what ingest now does), in the
  same run as one `replace_document` call a document.
Run it with PYTHONPATH set to a checkout before the change to time the old code itself (its
`flush()` is a no-op there, so every row is one transaction per document).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe_machine  # noqa: E402
from bench.pgvector_writes import CHUNKING, documents  # noqa: E402


def write_all(work: Path, docs: list, batch: int, dim: int, grouped: bool = False) -> tuple[float, float]:
    """(seconds in the writes + flush, seconds in save) for `docs` into a fresh collection.

    grouped: each batch of documents in one `replace_documents` call (as ingest writes what an
    embed batch completes), else one `replace_document` call a document.
    """
    from retrieval.records import DocumentWrite
    from retrieval.stores.embedded.catalog import Catalog
    from retrieval.stores.embedded.collection import EmbeddedCollection

    catalog = Catalog(work / "catalog.sqlite")
    info = catalog.create_collection("bench", "bench-random-vectors", "bench-random-vectors", dim, CHUNKING)
    store = EmbeddedCollection(catalog, info, work / "indexes", "faiss")
    # As ingest opens it (`rebuild.open_for_ingest`): without this every row was a transaction per
    # document whatever --batch said (the case from 5f40312 until 2026-12-07).
    store.batch_writes = True
    try:
        started = time.perf_counter()
        if grouped:
            for i in range(0, len(docs), batch):
                store.replace_documents([DocumentWrite(*d) for d in docs[i:i + batch]])
                store.flush()
        else:
            for n, (doc, acl, chunks, vectors) in enumerate(docs, 1):
                store.replace_document(doc, acl, chunks, vectors)
                if n % batch == 0:
                    store.flush()
        store.flush()
        written = time.perf_counter()
        store.save()
        assert catalog.collection_stats("bench")["documents"] == len(docs)
        return written - started, time.perf_counter() - written
    finally:
        catalog.close()


def main(args: argparse.Namespace) -> None:
    print(f"# {datetime.datetime.now().isoformat(timespec='minutes')}, {describe_machine(use_gpu=False)}")
    print(f"# {args.docs} documents x {args.chunks} chunks x {args.dim}-d, {args.words} words a chunk; "
          f"store code from {Path(__import__('retrieval').__file__).parent.parent}")
    t = time.perf_counter()
    corpus = documents(range(args.docs), args)
    print(f"# corpus generated in {time.perf_counter() - t:.0f} s")
    settings = [(b, g) for b in args.batch for g in ((False, True) if args.grouped and b > 1 else (False,))]
    results: dict[tuple[int, bool], list[tuple[float, float]]] = {k: [] for k in settings}
    for _ in range(args.rounds):
        for batch, grouped in settings:
            with tempfile.TemporaryDirectory(prefix="embedded-writes-") as tmp:
                results[batch, grouped].append(write_all(Path(tmp), corpus, batch, args.dim, grouped))
    print()
    print("| documents a transaction | calls | write s (each round) | save s | documents/s (best) | vs the first row |")
    print("|---|---|---|---|---|---|")
    base = None
    for (batch, grouped), runs in results.items():
        best = min(w + s for w, s in runs)
        rate = args.docs / best
        base = base or rate
        calls = "one a batch (replace_documents)" if grouped else "one a document"
        print(f"| {batch} | {calls} | {', '.join(f'{w:.1f}' for w, _ in runs)} | {min(s for _, s in runs):.1f} "
              f"| {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--chunks", type=int, default=1, help="chunks a document")
    parser.add_argument("--words", type=int, default=100, help="words a chunk")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256, 4096],
                        help="documents between flushes (the first row is the peer)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grouped", action="store_true",
                        help="also one replace_documents call a batch (as ingest writes), beside one call a document")
    main(parser.parse_args())
