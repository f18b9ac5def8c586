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


def _committed(path) -> list[tuple[str, int]]:
    """(key, chunks) of the documents another connection sees: only committed rows."""
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT d.key, COUNT(c.id) FROM documents d LEFT JOIN chunks c"
                            " ON c.document_id = d.id GROUP BY d.id ORDER BY d.key").fetchall()


def _ingest_index(catalog, tmp_path) -> EmbeddedCollection:
    """The collection as ingest opens it: a batch of documents per catalog transaction."""
    index = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    index.batch_writes = True
    return index


def test_direct_writes_commit_at_once_so_other_connections_see_them(tmp_path, catalog):
    index = EmbeddedCollection(catalog, catalog.get_collection("docs"), tmp_path / "idx")
    index.replace_document(_doc("a"), frozenset({"public"}), _chunks("a", 2), _vecs(2, 0))
    assert catalog.batch_documents == 0
    assert _committed(catalog.path) == [("a", 2)]


def test_batched_writes_commit_together_at_flush(tmp_path, catalog):
    index = _ingest_index(catalog, tmp_path)
    for i, key in enumerate("abc"):
        index.replace_document(_doc(key), frozenset({"public"}), _chunks(key, 2), _vecs(2, i))
    assert catalog.batch_documents == 3
    assert _committed(catalog.path) == []  # one open transaction: nothing is visible yet
    assert index.stats() == {"documents": 3, "chunks": 6}  # the writer reads its own writes
    index.flush()
    assert catalog.batch_documents == 0
    assert _committed(catalog.path) == [("a", 2), ("b", 2), ("c", 2)]


def test_a_failed_document_rolls_back_alone_inside_a_batch(tmp_path, catalog):
    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a", "v1"), frozenset({"public"}), _chunks("a", 2), _vecs(2, 0))
    index.flush()
    index.replace_document(_doc("b"), frozenset({"public"}), _chunks("b", 1), _vecs(1, 1))
    bad = [Chunk("a", 0, "dup", 1), Chunk("a", 0, "dup", 1)]  # violates UNIQUE(document, idx)
    with pytest.raises(sqlite3.IntegrityError):
        index.replace_document(_doc("a", "v2"), frozenset({"public"}), bad, _vecs(2, 1))
    index.replace_document(_doc("c"), frozenset({"public"}), _chunks("c", 1), _vecs(1, 2))
    index.flush()
    # "a" keeps its first version whole; the documents before and after it in the batch commit.
    assert _committed(catalog.path) == [("a", 2), ("b", 1), ("c", 1)]
    assert [r["text"] for r in catalog.dump("docs") if r["key"] == "a"] == ["a part 0", "a part 1"]


def test_a_batch_never_committed_leaves_no_part_of_a_document(tmp_path):
    """A process killed before the commit: its batch is gone whole, earlier batches stay."""
    path = tmp_path / "catalog.sqlite"
    script = f"""
import os, pathlib, numpy as np
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
c = Catalog(pathlib.Path({str(path)!r}))
c.create_collection("docs", "e", "fp", {DIM}, {{}})
index = EmbeddedCollection(c, c.get_collection("docs"), None)
index.batch_writes = True
def write(key, n):
    doc = Document(key=key, source=key, text="", content_hash=key, acl=None, title=key)
    chunks = [Chunk(document_key=key, index=i, text=f"{{key}} {{i}}", num_tokens=1) for i in range(n)]
    index.replace_document(doc, frozenset({{"public"}}), chunks, np.ones((n, {DIM}), np.float32))
write("a", 3); write("b", 1)
index.flush()
write("c", 2); write("d", 4)
os.kill(os.getpid(), 9)
"""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    assert _committed(path) == [("a", 3), ("b", 1)]


def test_other_writes_commit_an_open_batch_first(tmp_path, catalog):
    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a"), frozenset({"public"}), _chunks("a", 1), _vecs(1, 0))
    index.replace_document(_doc("b"), frozenset({"public"}), _chunks("b", 1), _vecs(1, 1))
    index.set_acl("a", frozenset({"user:bob"}))  # an ACL change is never held back in a batch
    assert _committed(catalog.path) == [("a", 1), ("b", 1)]
    index.replace_document(_doc("c"), frozenset({"public"}), _chunks("c", 1), _vecs(1, 2))
    index.delete_document("b")
    assert _committed(catalog.path) == [("a", 1), ("c", 1)]
    index.replace_document(_doc("d"), frozenset({"public"}), _chunks("d", 1), _vecs(1, 3))
    index.save()
    assert _committed(catalog.path) == [("a", 1), ("c", 1), ("d", 1)]
    assert catalog.version("docs") == index.loaded_version


def test_a_batch_commits_itself_when_full(tmp_path, catalog, monkeypatch):
    from retrieval.stores.embedded import catalog as catalog_module

    monkeypatch.setattr(catalog_module, "BATCH_DOCUMENTS", 2)
    index = _ingest_index(catalog, tmp_path)
    for i, key in enumerate("abc"):
        index.replace_document(_doc(key), frozenset({"public"}), _chunks(key, 1), _vecs(1, i))
    assert _committed(catalog.path) == [("a", 1), ("b", 1)] and catalog.batch_documents == 1


# -- a batch's keyword rows: indexed at its commit, one statement per domain ----------------


def _words(key: str, text: str) -> list[Chunk]:
    return [Chunk(document_key=key, index=0, text=text, num_tokens=len(text.split()))]


def _found(catalog, text: str, *tokens: str) -> list[str]:
    """Keys of the documents a keyword search by `tokens` finds for `text`."""
    ids = [cid for cid, _ in catalog.keyword_search("docs", text, 10, tokens)]
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    return sorted(k for (k,) in catalog.conn.execute(
        f"SELECT d.key FROM chunks c JOIN documents d ON d.id = c.document_id WHERE c.id IN ({marks})", ids))


def _domain_counts(path) -> dict[str, tuple[int, int]]:
    """ACL -> (num_chunks the keyword index keeps, chunks the catalog holds) per domain."""
    with sqlite3.connect(path) as conn:
        kept = dict(conn.execute("SELECT acl, num_chunks FROM keyword_domains").fetchall())
        held = dict(conn.execute("SELECT d.acl, COUNT(c.id) FROM documents d JOIN chunks c"
                                 " ON c.document_id = d.id GROUP BY d.acl").fetchall())
    return {acl: (kept.get(acl, 0), held.get(acl, 0)) for acl in set(kept) | set(held)}


def test_a_document_replaced_inside_its_batch_leaves_only_its_last_version_searchable(tmp_path, catalog):
    from retrieval.stores.embedded import keyword_index

    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a", "v1"), frozenset({"public"}), _words("a", "alpha harbour"), _vecs(1, 0))
    index.replace_document(_doc("b"), frozenset({"group:g1"}), _words("b", "beta lighthouse"), _vecs(1, 1))
    # The same key again in the same batch, under another ACL: its first version was never indexed.
    index.replace_document(_doc("a", "v2"), frozenset({"group:g1"}), _words("a", "gamma harbour"), _vecs(1, 2))
    index.flush()
    assert _found(catalog, "alpha") == [] and _found(catalog, "alpha", "group:g1") == []
    assert _found(catalog, "harbour", "public") == []  # the public version is gone with its text
    assert _found(catalog, "harbour", "group:g1") == ["a"]
    assert _found(catalog, "lighthouse", "group:g1") == ["b"]
    keyword_index.integrity_check(catalog.conn)  # the FTS index matches the chunks exactly
    assert all(kept == held for kept, held in _domain_counts(catalog.path).values())
    # Nothing was ever indexed and then removed, so no domain waits for a purge.
    assert not keyword_index.needs_purge(catalog.conn)


def test_a_replacement_in_a_later_batch_unindexes_the_committed_version(tmp_path, catalog):
    from retrieval.stores.embedded import keyword_index

    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a", "v1"), frozenset({"public"}), _words("a", "alpha harbour"), _vecs(1, 0))
    index.flush()
    index.replace_document(_doc("a", "v2"), frozenset({"public"}), _words("a", "gamma pier"), _vecs(1, 1))
    index.flush()
    assert _found(catalog, "alpha", "public") == [] and _found(catalog, "pier", "public") == ["a"]
    keyword_index.integrity_check(catalog.conn)
    assert keyword_index.needs_purge(catalog.conn)  # the first version's words wait in old segments
    assert all(kept == held for kept, held in _domain_counts(catalog.path).values())


def test_the_writer_finds_its_own_open_batch_by_keyword(tmp_path, catalog):
    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("b"), frozenset({"group:g1"}), _words("b", "beta lighthouse"), _vecs(1, 1))
    assert _committed(catalog.path) == []  # still one open transaction
    assert _found(catalog, "lighthouse", "group:g1") == ["b"]  # as its vector and row reads see it
    assert _found(catalog, "lighthouse", "public") == []
    index.replace_document(_doc("c"), frozenset({"group:g1"}), _words("c", "cove lighthouse"), _vecs(1, 2))
    index.flush()
    assert _found(catalog, "lighthouse", "group:g1") == ["b", "c"]
    assert all(kept == held for kept, held in _domain_counts(catalog.path).values())


def test_a_failure_indexing_a_batch_keywords_rolls_the_whole_batch_back(tmp_path, catalog, monkeypatch):
    from retrieval.stores.embedded import keyword_index

    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a"), frozenset({"public"}), _words("a", "alpha"), _vecs(1, 0))
    index.flush()
    index.replace_document(_doc("b"), frozenset({"public"}), _words("b", "beta"), _vecs(1, 1))
    index.replace_document(_doc("c"), frozenset({"group:g1"}), _words("c", "gamma"), _vecs(1, 2))

    def broken(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(keyword_index, "index_chunks", broken)
    with pytest.raises(sqlite3.OperationalError):
        index.flush()
    monkeypatch.undo()
    # No document of the batch is committed without its keyword rows: the batch is gone whole.
    assert _committed(catalog.path) == [("a", 1)] and catalog.batch_documents == 0
    again = _ingest_index(catalog, tmp_path)  # a rerun writes them again
    again.replace_document(_doc("b"), frozenset({"public"}), _words("b", "beta"), _vecs(1, 1))
    again.flush()
    assert _found(catalog, "beta", "public") == ["b"] and _found(catalog, "gamma", "group:g1") == []
    keyword_index.integrity_check(catalog.conn)
    assert all(kept == held for kept, held in _domain_counts(catalog.path).values())


def test_a_batch_that_sqlite_rolled_back_leaves_no_keyword_rows_queued(tmp_path, catalog):
    """Its chunk ids are reused by the next inserts: indexing its queued text under them would be wrong."""
    from retrieval.stores.embedded import keyword_index

    index = _ingest_index(catalog, tmp_path)
    index.replace_document(_doc("a"), frozenset({"group:g1"}), _words("a", "secret harbour"), _vecs(1, 0))
    catalog.conn.execute("ROLLBACK")  # what SQLite does to the whole transaction on disk full or I/O error
    index.replace_document(_doc("b"), frozenset({"group:g1"}), _words("b", "plain lighthouse"), _vecs(1, 1))
    index.flush()
    assert _committed(catalog.path) == [("b", 1)]
    assert _found(catalog, "secret", "group:g1") == [] and _found(catalog, "lighthouse", "group:g1") == ["b"]
    keyword_index.integrity_check(catalog.conn)
    assert all(kept == held for kept, held in _domain_counts(catalog.path).values())


# -- several documents in one call (`replace_documents`, what ingest writes per embed batch) ----


def _write(key: str, n: int, seed: int, acl: frozenset[str] = frozenset({"public"}), text: str = "x"):
    from retrieval.records import DocumentWrite

    return DocumentWrite(_doc(key, text), acl, _chunks(key, n), _vecs(n, seed))


def test_documents_written_together_get_the_rows_and_ids_of_one_by_one_writes(tmp_path):
    # Ids are assigned by the write itself: they must be what AUTOINCREMENT gives (fresh: 1, 2, ...
    # in write order; after a replacement, past every id used), however the documents are grouped,
    # so the vector index (which follows chunk ids) and every reader see the same catalog.
    first = [_write("a", 2, 0), _write("b", 3, 1, frozenset({"group:x", "user:u"})), _write("c", 1, 2)]
    second = [_write("b", 1, 3, frozenset({"group:y"}), "v2"), _write("d", 0, 4), _write("e", 2, 5)]
    dumps, ids, results = [], [], []
    for mode in ("one", "many"):
        catalog = Catalog(tmp_path / f"{mode}.sqlite")
        catalog.create_collection("docs", "test-embedder", "fp1", DIM, {"max_tokens": 100})
        got = []
        for writes in (first, second):
            if mode == "one":
                got += [catalog.replace_document("docs", *w, batched=True) for w in writes]
            else:
                got += catalog.replace_documents("docs", writes, batched=True)
            catalog.commit()
        results.append(got)
        dumps.append(catalog.dump("docs"))
        ids.append(catalog.conn.execute(
            "SELECT d.key, d.id, c.id FROM documents d LEFT JOIN chunks c ON c.document_id = d.id ORDER BY 1, 3"
        ).fetchall())
        assert _found(catalog, "part", "group:y") == ["b"] and _found(catalog, "part", "group:x") == []
        assert catalog.version("docs") == 6
        catalog.close()
    assert results[0] == results[1] and ids[0] == ids[1]
    assert [added for _, added in results[0]] == [[1, 2], [3, 4, 5], [6], [7], [], [8, 9]]
    assert results[0][3][0] == [3, 4, 5]  # the new "b" removed the old one's chunks
    assert [{k: v for k, v in r.items() if k != "vector"} for r in dumps[0]] == \
        [{k: v for k, v in r.items() if k != "vector"} for r in dumps[1]]


def test_ids_of_deleted_rows_are_never_given_again(tmp_path, catalog):
    # The vector index may still hold a removed id until it is saved: the catalog never reuses one.
    index = _ingest_index(catalog, tmp_path)
    index.replace_documents([_write("a", 2, 0), _write("b", 2, 1)])
    index.flush()
    top = catalog.conn.execute("SELECT max(id) FROM chunks").fetchone()[0]
    index.delete_document("b")  # the highest ids go
    index.replace_documents([_write("c", 2, 2)])
    index.flush()
    new = [r[0] for r in catalog.conn.execute(
        "SELECT c.id FROM chunks c JOIN documents d ON d.id = c.document_id WHERE d.key = 'c'")]
    assert min(new) > top


def test_documents_written_together_roll_back_together_and_alone(tmp_path, catalog):
    index = _ingest_index(catalog, tmp_path)
    index.replace_documents([_write("a", 2, 0, text="v1")])
    index.flush()
    index.replace_document(_doc("b"), frozenset({"public"}), _chunks("b", 1), _vecs(1, 1))
    bad = _write("a", 2, 1, text="v2")._replace(chunks=[Chunk("a", 0, "dup", 1), Chunk("a", 0, "dup", 1)])
    with pytest.raises(sqlite3.IntegrityError):  # UNIQUE(document, idx)
        index.replace_documents([_write("new", 1, 2, text="token-of-the-failed-group"), bad])
    index.replace_documents([_write("c", 1, 3)])
    index.flush()
    # Nothing of the failed group ("new", the new "a"); the documents of the batch before and after it commit.
    assert _committed(catalog.path) == [("a", 2), ("b", 1), ("c", 1)]
    assert [r["text"] for r in catalog.dump("docs") if r["key"] == "a"] == ["a part 0", "a part 1"]
    assert _found(catalog, "token-of-the-failed-group", "public") == []
    assert _found(catalog, "part", "public") == ["a", "a", "b", "c"]  # one hit a chunk
