"""Catalog + EmbeddedCollection: transactions, ACL filtering, index files that follow versions."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from permissions.models import Principal
from permissions.policy import store_filter
from rag.errors import NotFoundError, StoreError
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection

DIM = 8


def _doc(key: str, text: str = "x") -> Document:
    return Document(key=key, source=f"/src/{key}", text=text, content_hash=f"h-{key}-{text}",
                    acl=None, title=key)


def _chunks(key: str, n: int) -> list[Chunk]:
    return [Chunk(document_key=key, index=i, text=f"{key} part {i}", num_tokens=3)
            for i in range(n)]


def _vecs(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture
def catalog(tmp_path):
    c = Catalog(tmp_path / "catalog.sqlite")
    c.create_collection("docs", "test-embedder", "fp1", DIM, {"max_tokens": 100})
    yield c
    c.close()


def test_unknown_collection_names_the_existing_ones(catalog):
    with pytest.raises(NotFoundError, match="unknown collection 'nope'.*docs"):
        catalog.get_collection("nope")


def test_embedder_mismatch_is_refused(catalog):
    with pytest.raises(StoreError, match="same embedder"):
        catalog.create_collection("docs", "other", "fp2", 16, {})


def test_acl_filter_and_set_acl(catalog):
    catalog.replace_document("docs", _doc("a"), frozenset({"group:g1"}), _chunks("a", 2), _vecs(2, 0))
    catalog.replace_document("docs", _doc("b"), frozenset({"public"}), _chunks("b", 1), _vecs(1, 1))
    alice = Principal("alice", frozenset({"g1"}))
    bob = Principal("bob")
    assert len(catalog.allowed_chunk_ids("docs", store_filter(alice))) == 3
    assert len(catalog.allowed_chunk_ids("docs", store_filter(bob))) == 1
    catalog.set_acl("docs", "a", frozenset({"user:bob"}))
    assert len(catalog.allowed_chunk_ids("docs", store_filter(alice))) == 1
    assert len(catalog.allowed_chunk_ids("docs", store_filter(bob))) == 3
    assert catalog.allowed_chunk_ids("docs", []).size == 0


def test_replace_is_atomic_when_a_write_fails(catalog):
    catalog.replace_document("docs", _doc("a", "v1"), frozenset({"public"}), _chunks("a", 2), _vecs(2, 0))
    before = catalog.dump("docs")
    bad = [Chunk("a", 0, "dup", 1), Chunk("a", 0, "dup", 1)]  # violates UNIQUE(document, idx)
    with pytest.raises(sqlite3.IntegrityError):
        catalog.replace_document("docs", _doc("a", "v2"), frozenset({"public"}), bad, _vecs(2, 1))
    after = catalog.dump("docs")
    assert [r["text"] for r in after] == [r["text"] for r in before]


def test_index_follows_catalog_and_rebuilds_after_a_crash(tmp_path, catalog):
    index = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    v = _vecs(3, 5)
    index.replace_document(_doc("a"), frozenset({"public"}), _chunks("a", 3), v)
    index.save()
    files = list((tmp_path / "idx").glob("*.faiss"))
    assert len(files) == 1 and f"v{catalog.version('docs')}" in files[0].name
    # A write that never reached the index file (as if the process died before save).
    catalog.replace_document("docs", _doc("b"), frozenset({"public"}), _chunks("b", 1), v[:1])
    reopened = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    assert reopened.vectors.count() == 4
    allowed = catalog.allowed_chunk_ids("docs", {"public"})
    hits = reopened.vectors.search(v[0], 4, allowed)
    # The vector written only to the catalog is back in the rebuilt index, with the others.
    assert {int(i) for i, _ in hits} == {int(i) for i in allowed} and len(allowed) == 4


def test_delete_document_removes_vectors(tmp_path, catalog):
    index = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    index.replace_document(_doc("a"), frozenset({"public"}), _chunks("a", 2), _vecs(2, 0))
    index.replace_document(_doc("b"), frozenset({"public"}), _chunks("b", 2), _vecs(2, 1))
    index.delete_document("a")
    assert index.vectors.count() == 2
    assert catalog.collection_stats("docs") == {"documents": 1, "chunks": 2}


def test_refresh_sees_another_writer(tmp_path, catalog):
    index = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    other = Catalog(catalog.path)
    other.replace_document("docs", _doc("z"), frozenset({"public"}), _chunks("z", 2), _vecs(2, 3))
    assert index.refresh() is True
    assert index.vectors.count() == 2
    assert index.refresh() is False
    other.close()
