"""Nothing an ingest wrote is invisible after `Rag.ingest` returns (issue 17, a confirmation).

A session once counted 194 of 212 documents from a separate sqlite3 connection after
`Rag.ingest` returned, with the Rag still open. This reproduces that setup over ~200 documents,
with small embed batches (many commits, documents spanning batches through staging) and a
rebuild beside the live collection, and counts what other readers see: another connection in
this process, another process, the catalog file copied alone (as a backup tool would copy it,
without its WAL), and after close. None of them has ever seen fewer documents than the report.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

DOCUMENTS = 212
COUNT = ("SELECT (SELECT count(*) FROM documents WHERE collection = ?), "
         "(SELECT count(*) FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.collection = ?)")


def _corpus(root: Path) -> Path:
    """DOCUMENTS small notes in nested folders; every 25th is long enough to span embed batches."""
    for i in range(DOCUMENTS):
        folder = root / f"group{i % 7}" / f"year{2020 + i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        paragraphs = 30 if i % 25 == 0 else 1 + i % 4
        body = "\n\n".join(f"Note {i}, paragraph {p}: the sample {i % 13} was measured on day {p}." * 3
                           for p in range(paragraphs))
        (folder / f"note-{i:03d}{'.md' if i % 2 else '.txt'}").write_text(f"# Note {i}\n\n{body}\n")
    return root


def _count_here(catalog: Path, collection: str = "default") -> tuple[int, int]:
    with sqlite3.connect(catalog) as conn:
        return conn.execute(COUNT, (collection, collection)).fetchone()


def _count_in_another_process(catalog: Path, collection: str = "default") -> tuple[int, int]:
    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "print(*c.execute(sys.argv[2], (sys.argv[3], sys.argv[3])).fetchone())")
    out = subprocess.run([sys.executable, "-c", code, str(catalog), COUNT, collection],
                         capture_output=True, text=True, timeout=120, check=True)
    documents, chunks = out.stdout.split()
    return int(documents), int(chunks)


def _count_of_the_file_alone(catalog: Path, tmp: Path) -> tuple[int, int]:
    """What a copy of just catalog.sqlite holds: commits still only in the WAL are missing from it."""
    copy = tmp / "copied-alone.sqlite"
    shutil.copyfile(catalog, copy)
    return _count_here(copy)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _corpus(tmp_path_factory.mktemp("visibility") / "notes")


def test_every_ingested_document_is_visible_to_other_readers_while_the_rag_is_open(
        corpus, rag_factory, tmp_path):
    rag = rag_factory(tmp_path / "home", ingest_batch_chunks=16)  # many commits, spanning documents
    catalog = rag.settings.catalog_path
    try:
        report = rag.ingest([corpus], progress=False)
        assert report.ok and report.added == DOCUMENTS
        stats = rag.collection().stats()
        assert stats["documents"] == DOCUMENTS and stats["chunks"] > DOCUMENTS + 16  # some spanned batches
        expected = (DOCUMENTS, stats["chunks"])
        assert _count_here(catalog) == expected
        assert _count_in_another_process(catalog) == expected
        assert _count_of_the_file_alone(catalog, tmp_path) == expected  # the WAL was checkpointed
    finally:
        rag.close()
    assert _count_here(catalog) == expected
    assert _count_in_another_process(catalog) == expected


def test_a_rebuild_is_visible_to_other_readers_and_to_a_rag_left_open(corpus, rag_factory, tmp_path):
    home = tmp_path / "home"
    service = rag_factory(home, ingest_batch_chunks=16)  # a long-lived reader, as `rag serve` is
    try:
        assert service.ingest([corpus], progress=False).added == DOCUMENTS
        first = service.collection().stats()
        # Another chunking builds version 2 beside the live one and switches to it on completion.
        rebuild = rag_factory(home, ingest_batch_chunks=16, chunk_max_tokens=48, chunk_overlap_tokens=8)
        try:
            report = rebuild.ingest([corpus], progress=False)
            assert report.ok and report.build is not None and report.build.switched
            rebuilt = rebuild.collection().stats()
        finally:
            rebuild.close()
        assert rebuilt["documents"] == DOCUMENTS and rebuilt["chunks"] > first["chunks"]
        expected = (DOCUMENTS, rebuilt["chunks"])
        assert _count_here(home / "catalog.sqlite") == expected
        assert _count_in_another_process(home / "catalog.sqlite") == expected
        store = service.collection()
        store.refresh()
        assert store.stats() == rebuilt
    finally:
        service.close()
