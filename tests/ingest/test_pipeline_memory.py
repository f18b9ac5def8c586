"""Ingest streams: the walk is consumed lazily and only a batch of documents waits for the embedder.

The figures for real corpora (peak RSS at 5k-20k documents) come from bench/ingest_memory.py;
these tests pin down the structure that keeps that peak flat.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ingest.chunk import Chunker, ChunkingConfig
from ingest.pipeline import IngestPipeline
from ingest.sources import SourceItem, count_sources, walk_sources
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection

NUM_RECORDS = 1800
NUM_FILES = 200
BATCH = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~2k tiny documents: a JSONL file of records and small files in nested directories."""
    root = tmp_path_factory.mktemp("corpus")
    (root / ".rag-acl.toml").write_text('allow = ["public"]\n')
    with (root / "notes.jsonl").open("w") as f:
        for i in range(NUM_RECORDS):
            f.write(json.dumps({"id": f"n{i}", "text": f"Note {i}: freezer {i % 13}."}) + "\n")
    for i in range(NUM_FILES):
        d = root / f"d{i % 10}" / f"e{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"File {i} lists rack {i % 7}.\n")
    return root


def test_count_matches_the_walk(corpus: Path) -> None:
    assert count_sources([corpus]) == sum(1 for _ in walk_sources([corpus])) == NUM_RECORDS + NUM_FILES


def test_jsonl_records_are_read_one_line_at_a_time(tmp_path: Path) -> None:
    # 4 MB of records: walking them must not hold the file (the old walk read it whole).
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(2000):
            f.write(json.dumps({"id": i, "text": f"record {i} " + "x" * 2000}) + "\n")
    tracemalloc.start()
    try:
        count = 0
        for item in walk_sources([path]):
            assert isinstance(item, SourceItem)
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 2000
    assert peak < path.stat().st_size / 8, f"walking a {path.stat().st_size} byte file peaked at {peak} bytes"


def _store_records_as_unchanged(catalog: Catalog, collection: str, corpus: Path, dim: int) -> None:
    """What an earlier run would have left for the JSONL records (so this run embeds only the files)."""
    vector = np.zeros((1, dim), dtype=np.float32)
    vector[0, 0] = 1.0
    for item in walk_sources([corpus]):
        if isinstance(item, SourceItem) and item.kind == "record":
            doc = Document(key=item.key, source=item.key, text=item.text or "", content_hash=item.content_hash,
                           acl=item.acl)
            catalog.replace_document(collection, doc, item.acl, [Chunk(item.key, 0, item.text or "", 5)], vector)


@pytest.mark.parametrize(("overlap", "write_behind"), [(True, True), (True, False), (False, False)],
                         ids=["write-behind", "embed-overlapped", "one-thing-at-a-time"])
def test_documents_are_written_while_the_walk_goes_on(tmp_path: Path, corpus: Path, embedder, overlap: bool,
                                                      write_behind: bool) -> None:
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("c", embedder.name, embedder.fingerprint, embedder.dim,
                                     {"max_tokens": 200, "overlap_tokens": 32})
    _store_records_as_unchanged(catalog, "c", corpus, embedder.dim)
    index = EmbeddedCollection(catalog, info, tmp_path / "indexes")
    pipeline = IngestPipeline(index, embedder.embed, Chunker(embedder.tokenizer, ChunkingConfig()),
                              batch_chunks=BATCH, overlap_embedding=overlap, write_behind=write_behind)
    walked: list[tuple[int, int]] = []  # (sources walked, of total) when each batch was written
    last = {"ingest": (0, 0)}

    def progress(stage: str, done: int, total: int) -> None:
        last[stage] = (done, total)
        if stage == "embed":
            walked.append(last["ingest"])
            # Each batch is in the catalog (its own transactions) when progress counts it.
            assert catalog.collection_stats("c")["documents"] == NUM_RECORDS + done

    report = pipeline.run([corpus], progress)
    total = NUM_RECORDS + NUM_FILES
    assert report.ok and report.added == NUM_FILES and report.unchanged == NUM_RECORDS
    # The files come first in the walk (d*/ sorts before notes.jsonl), one chunk each: a batch
    # is embedded and written as soon as BATCH documents wait, not when the walk ends. With the
    # embedding overlapped, a batch is written when the next one goes to the embedder (the walk
    # has gone one batch further), never later.
    # With write-behind the writer thread commits each batch while the walk goes on, and progress
    # says so at the next source walked after it: how far the walk got by then is the threads'
    # timing (tests/ingest/test_batch_commit.py shows the walk going on during a write), but it
    # never counts a batch that is not in the catalog (the assert in `progress`).
    expected = [BATCH, 2 * BATCH, 3 * BATCH, total]
    if write_behind:
        positions = [w for w, _ in walked]
        assert positions == sorted(positions) and positions[-1] == total and positions[0] >= BATCH
    else:
        assert [w for w, _ in walked] == (expected[1:] + [total] if overlap else expected)
    assert all(t == total for _, t in walked)
    assert pipeline.max_pending_chunks == BATCH
    assert catalog.collection_stats("c") == {"documents": total, "chunks": total}
    catalog.close()
