"""Deleted, replaced and re-permissioned text does not stay readable in the embedded store's files.

Each test writes a document carrying a unique marker, checks the marker is on disk (so the
search below can see it), removes or changes the document, saves, then reads every file under
the data directory as raw bytes: SQLite database, -wal, -shm and the Faiss index files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rag.types import Chunk, Document
from retrieval.stores.embedded import keyword_index
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection

DIM = 8
MARKER = "qzmarkerq7731"  # lower case: the keyword index stores folded terms


def _bytes_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _holding(root: Path, needle: str) -> list[str]:
    return [name for name, data in _bytes_under(root).items() if needle.encode() in data]


def _put(index: EmbeddedCollection, key: str, texts: list[str], acl: set[str], title: str | None = None) -> None:
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split()), heading=None)
              for i, t in enumerate(texts)]
    doc = Document(key=key, source=f"/lab/{key}", text="\n".join(texts), content_hash=str(hash(tuple(texts))),
                   acl=frozenset(acl), title=title)
    rng = np.random.default_rng(len(key))
    vectors = rng.normal(size=(len(chunks), DIM)).astype(np.float32)
    index.replace_document(doc, frozenset(acl), chunks, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))


@pytest.fixture(params=["faiss", "faiss-hnsw"])
def index(request, tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("docs", "test-embedder", "fp", DIM, {})
    idx = EmbeddedCollection(catalog, info, tmp_path / "indexes", request.param)
    # Neighbours in the same ACL domain, so removals rewrite a domain that stays (not only drops).
    for i in range(30):
        _put(idx, f"notes{i}.md", [f"beamline notes {i}: flux calibration and shutter timing"] * 3,
             {"group:imaging"})
    for i in range(5):
        _put(idx, f"public{i}.md", [f"the user guide, page {i}"], {"public"})
    idx.save()
    yield idx
    catalog.close()


def _secret(index: EmbeddedCollection) -> None:
    _put(index, f"{MARKER}-plan.md", [f"the {MARKER} incident plan, step {j}" for j in range(4)],
         {"group:imaging"}, title=f"Plan {MARKER}")
    index.save()
    assert _holding(index.catalog.path.parent, MARKER), "the marker must be visible on disk before removal"


def test_a_deleted_document_leaves_no_text_on_disk(index):
    _secret(index)
    index.delete_document(f"{MARKER}-plan.md")
    index.save()
    assert _holding(index.catalog.path.parent, MARKER) == []
    assert index.keyword_search("beamline", 5, ["group:imaging"])  # the neighbours are intact
    keyword_index.integrity_check(index.catalog.conn)


def test_replaced_text_leaves_no_trace_on_disk(index):
    _secret(index)
    _put(index, f"{MARKER}-plan.md", ["the incident plan, rewritten without the code name"], {"group:imaging"},
         title="Plan")
    index.save()
    # The key still names the marker (the document exists); its old text and title are gone.
    key = f"{MARKER}-plan.md".encode()
    for name, data in _bytes_under(index.catalog.path.parent).items():
        assert data.count(MARKER.encode()) == data.count(key), name
    assert index.keyword_search(MARKER, 5, ["group:imaging"]) == []
    keyword_index.integrity_check(index.catalog.conn)


def test_a_deleted_last_document_of_its_acl_drops_the_domain(index):
    _put(index, "alone.md", [f"the only {MARKER} note of its group"], {"group:secret"})
    index.save()
    assert _holding(index.catalog.path.parent, MARKER)
    index.delete_document("alone.md")
    index.save()
    assert _holding(index.catalog.path.parent, MARKER) == []
    rows = index.catalog.conn.execute("SELECT 1 FROM keyword_domains WHERE acl = ?", ('["group:secret"]',))
    assert rows.fetchall() == []


def _domain_blocks(catalog: Catalog, acl: str) -> bytes:
    (domain_id,) = catalog.conn.execute("SELECT id FROM keyword_domains WHERE acl = ?", (acl,)).fetchone()
    table = keyword_index.table_name(domain_id)
    return b"".join(r[0] or b"" for r in catalog.conn.execute(f"SELECT block FROM {table}_data"))


def test_a_re_permissioned_document_leaves_its_old_acl_domain(index):
    """Moved from group:imaging to group:secret: the imaging domain's index no longer holds its words."""
    _secret(index)
    old = '["group:imaging"]'
    assert MARKER.encode() in _domain_blocks(index.catalog, old)
    index.set_acl(f"{MARKER}-plan.md", frozenset({"group:secret"}))
    index.save()
    assert MARKER.encode() not in _domain_blocks(index.catalog, old)
    assert MARKER.encode() in _domain_blocks(index.catalog, '["group:secret"]')
    assert index.keyword_search(MARKER, 5, ["group:imaging"]) == []
    assert len(index.keyword_search(MARKER, 5, ["group:secret"])) == 4
    keyword_index.integrity_check(index.catalog.conn)


def test_the_wal_is_emptied_after_a_removal(index):
    _secret(index)
    index.delete_document(f"{MARKER}-plan.md")
    index.save()
    wal = index.catalog.path.with_name(index.catalog.path.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0


@pytest.mark.parametrize(("kind", "rows"), [("faiss", 50), ("faiss-ivf", 50), ("faiss-ivf", 1100)])
def test_a_removed_vector_is_not_in_the_saved_index_file(tmp_path, kind, rows):
    """Flat and IVF files drop a removed vector (HNSW keeps it in its graph until compaction: documented)."""
    from retrieval.vectors import make_vector_index

    store = make_vector_index(kind, DIM, None)
    vectors = np.random.default_rng(7).normal(size=(rows, DIM)).astype(np.float32)
    store.add(np.arange(rows, dtype=np.int64), vectors)
    path = tmp_path / "index.bin"
    store.save(path)
    assert vectors[3].tobytes() in path.read_bytes()
    store.remove(np.array([3], dtype=np.int64))
    store.save(path)
    assert vectors[3].tobytes() not in path.read_bytes()
    assert vectors[4].tobytes() in path.read_bytes()


def test_a_dropped_collection_leaves_no_text_in_the_catalog_files(index):
    _secret(index)
    catalog = index.catalog
    catalog.drop_collection("docs", batch=7)
    catalog_files = [n for n in _holding(catalog.path.parent, MARKER) if n.startswith(catalog.path.name)]
    assert catalog_files == []
    assert catalog.conn.execute("SELECT COUNT(*) FROM keyword_domains").fetchone()[0] == 0
