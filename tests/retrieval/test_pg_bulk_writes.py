"""Bulk writes of the pgvector store: batches per transaction, the HNSW index built after a load, kill -9 resume."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psycopg
import pytest

from rag.types import Chunk, Document
from retrieval.records import BuildSpec
from retrieval.stores.pgvector import bulk
from retrieval.stores.pgvector.bulk import index_memory_mb
from retrieval.stores.pgvector.collection import PgvectorCollection, create_collection, open_collection
from retrieval.stores.pgvector.rebuild import PgvectorBuild, open_for_ingest
from retrieval.stores.pgvector.schema import hnsw_index_exists, keyword_index_exists, keyword_index_name
from tests.pg_fixture import fresh_database

DIM = 16
SPEC = BuildSpec("test-embedder", "fp-1", DIM, {"max_tokens": 64})
ROOT = Path(__file__).resolve().parents[2]


def _doc(d: int, version: str = "v1", acl: frozenset[str] | None = None):
    rng = np.random.default_rng(d)
    key = f"doc{d:04d}"
    texts = [f"{version} {key} part {i} alpha beta {rng.integers(1000)}" for i in range(1 + d % 4)]
    vectors = rng.standard_normal((len(texts), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    acl = acl or frozenset({f"group:g{d % 3}"})
    doc = Document(key=key, source=f"/lab/{key}.md", text="\n".join(texts), content_hash=f"{version}-{d}", acl=acl,
                   title=key, metadata={"n": d})
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split()), heading=f"H{i}")
              for i, t in enumerate(texts)]
    return doc, acl, chunks, vectors


def _count(dsn: str, collection: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM rag_documents WHERE collection = %s", (collection,)).fetchone()[0]


def _has_index(dsn: str, collection: str) -> bool:
    """Whether the collection has both its HNSW and keyword indexes (False: neither; anything else fails)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        hnsw, keyword = hnsw_index_exists(conn, collection), keyword_index_exists(conn, collection)
    assert hnsw == keyword, f"{collection}: HNSW index {hnsw}, keyword index {keyword}"
    return hnsw


def _rows(dsn: str) -> tuple[list, list, list]:
    """Every stored row of every collection, ids and generated columns included (timestamps excluded)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        chunks = conn.execute(
            "SELECT id, collection, document_key, idx, text, heading, num_tokens, metadata, acl, embedding::text,"
            ' rag_chunk_keys(collection, acl, tsv), tsv::text FROM rag_chunks ORDER BY id').fetchall()
        docs = conn.execute("SELECT collection, key, source, title, content_hash, acl, metadata, num_chunks"
                            ' FROM rag_documents ORDER BY collection, key COLLATE "C"').fetchall()
        indexes = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'rag_chunks'"
                               " ORDER BY indexname").fetchall()
    return chunks, docs, indexes


def test_documents_commit_a_batch_at_a_time_and_the_index_is_built_when_the_load_ends(pg_dsn):
    store = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=5)
    assert isinstance(store, PgvectorCollection) and not _has_index(pg_dsn, "lab")
    for d in range(4):
        store.replace_document(*_doc(d))
    assert _count(pg_dsn, "lab") == 0  # buffered, not committed yet
    store.replace_document(*_doc(4))
    assert _count(pg_dsn, "lab") == 5  # the batch is full: one transaction
    for d in range(5, 12):
        store.replace_document(*_doc(d))
    assert store.stats()["documents"] == 12  # a read commits what is buffered first
    assert not _has_index(pg_dsn, "lab")
    store.save()
    assert _has_index(pg_dsn, "lab")

    # The same documents written one per transaction into a collection created with its index.
    per_doc = create_collection(pg_dsn, "other", "test-embedder", "fp-1", DIM, {"max_tokens": 64})
    for d in range(12):
        per_doc.replace_document(*_doc(d))

    def canonical(rows: list[dict]) -> list:
        return [(r["key"], r["hash"], r["acl"], r["title"], r["index"], r["text"], r["heading"],
                 r["vector"].tolist()) for r in rows]

    assert canonical(store.dump()) == canonical(per_doc.dump())
    hits = store.keyword_search("alpha", 50, ["group:g1"])
    assert {r.document_key for r in store.chunk_records([i for i, _ in hits]).values()} == \
        {f"doc{d:04d}" for d in range(12) if d % 3 == 1}

    # After the load, writes maintain the index; a replaced document loses its old chunks;
    # an ACL change reaches a buffered document too, vectors untouched.
    store.replace_document(*_doc(3, version="v2"))
    store.replace_document(*_doc(20))
    store.set_acl("doc0020", frozenset({"user:alice"}))
    rows = {(r["key"], r["index"]): r for r in store.dump()}
    assert [r["text"].split()[0] for k, r in rows.items() if k[0] == "doc0003"] == ["v2"] * 4
    assert rows[("doc0020", 0)]["acl"] == ["user:alice"]
    assert np.array_equal(rows[("doc0020", 0)]["vector"], _doc(20)[3][0])
    assert store.search(_doc(20)[3][0], 1, ["user:alice"], exact=True)[0][1] == pytest.approx(1.0, abs=1e-5)
    assert _has_index(pg_dsn, "lab")
    store.close()
    per_doc.close()


def test_the_last_of_several_loaders_builds_the_index(pg_dsn):
    a = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=3)
    b = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=3)
    for d in range(0, 10, 2):
        a.replace_document(*_doc(d))
    for d in range(1, 10, 2):
        b.replace_document(*_doc(d))
    a.flush()
    b.flush()
    assert b.end_load(wait=False) is False  # a is still loading: it builds the index when it ends
    assert not _has_index(pg_dsn, "lab")
    assert a.end_load(wait=False) is True
    assert _has_index(pg_dsn, "lab")
    assert a.stats() == {"documents": 10, "chunks": sum(1 + d % 4 for d in range(10))}
    # A writer that finds the index in place writes incrementally; a save builds nothing.
    b.replace_document(*_doc(11))
    b.save()
    assert b.stats()["documents"] == 11
    a.close()
    b.close()


def test_a_killed_loader_leaves_the_index_to_whoever_saves_next(pg_dsn):
    killed = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=2)
    for d in range(4):
        killed.replace_document(*_doc(d))
    killed._session.close()  # its connection ends without a save, as a killed process's does
    again = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=2)
    assert again.document_states().keys() == {f"doc{d:04d}" for d in range(4)}
    again.save()
    assert _has_index(pg_dsn, "lab")
    again.close()


def test_a_rebuild_is_loaded_without_an_index_and_switches_only_with_one(pg_dsn):
    live = open_for_ingest(pg_dsn, "lab", BuildSpec("old-embedder", "fp-0", DIM, {"max_tokens": 32}))
    for d in range(6):
        live.replace_document(*_doc(d))
    live.save()
    live.close()
    build = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=4)
    assert isinstance(build, PgvectorBuild)
    for d in range(6):
        build.replace_document(*_doc(d, version="v2"))
    build.flush()
    assert not _has_index(pg_dsn, "lab@2") and _count(pg_dsn, "lab@2") == 6
    build.save()
    outcome = build.finish()
    assert outcome.switched and _has_index(pg_dsn, "lab@2") and _count(pg_dsn, "lab") == 0
    assert not _has_index(pg_dsn, "lab")  # the old version's indexes went with it
    build.close()


def test_the_index_builds_at_the_end_of_a_load_wait_for_other_writers_without_deadlock(pg_dsn):
    """The keyword index is built on a second connection beside the HNSW build; writers of other
    collections queued between the two builds' locks must not leave them waiting on each other."""
    store = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=4)
    for d in range(8):
        store.replace_document(*_doc(d))
    store.flush()
    first = psycopg.connect(pg_dsn)  # a writer of another collection, in the middle of its batch
    first.execute("LOCK TABLE rag_chunks IN ROW EXCLUSIVE MODE")
    ended: list[bool] = []
    builder = threading.Thread(target=lambda: ended.append(store.end_load(wait=False)))
    builder.start()

    def queued_writer() -> None:  # arrives while a build waits for `first`: queues behind it
        with psycopg.connect(pg_dsn) as conn:
            conn.execute("LOCK TABLE rag_chunks IN ROW EXCLUSIVE MODE")
            conn.commit()

    time.sleep(0.5)
    second = threading.Thread(target=queued_writer)
    second.start()
    time.sleep(0.5)
    first.commit()
    first.close()
    builder.join(timeout=60)
    second.join(timeout=60)
    assert not builder.is_alive() and not second.is_alive(), "the index builds and a writer deadlocked"
    assert ended == [True]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert hnsw_index_exists(conn, "lab") and keyword_index_exists(conn, "lab")
    store.close()


def test_index_memory_fits_the_graph_within_bounds():
    assert index_memory_mb(0, 384, 1024) == 64
    assert 300 < index_memory_mb(160_000, 384, 4096) < 600
    assert index_memory_mb(10_000_000, 384, 1024) == 1024


def test_the_index_memory_setting_reaches_the_collections_ingest_writes(pg_dsn, tmp_path):
    from rag.pipeline import Rag
    from rag.settings import Settings

    # Through Rag, as `rag ingest` builds its stores, so the setting's whole path is checked.
    rag = Rag(Settings(home=tmp_path, store="pgvector", dsn=pg_dsn, pg_index_memory_mb=4096))
    try:
        target = rag.stores.for_ingest("big", SPEC)
        assert target.index_memory_mb == 4096 and target._load.max_memory_mb == 4096
    finally:
        rag.close()


# Migration 3's key function, the body of the `kw` column until migration 5 replaced it.
_OLD_KEYS = """CREATE FUNCTION pg_temp.old_keys(collection text, acl text[], heading text, body text)
    RETURNS text[] LANGUAGE sql IMMUTABLE
    AS $$ SELECT coalesce(array_agg(rag_keyword_domain(collection, acl) || ':' || l.lexeme), '{}')
          FROM unnest(to_tsvector('english', coalesce(heading, '')) || to_tsvector('english', body)) AS l $$"""


def test_keyword_index_keys_are_the_kw_column_of_before(pg_dsn):
    """The keys migration 5 indexes, from `tsv`, are exactly what the `kw` column stored."""
    store = create_collection(pg_dsn, "lab", "test-embedder", "fp-1", DIM, {})
    store.replace_document(*_doc(7))
    store.close()
    tsv = ("setweight(to_tsvector('english', coalesce(%(h)s::text, '')), 'A')"
           " || setweight(to_tsvector('english', %(b)s::text), 'B')")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(_OLD_KEYS)
        rows = conn.execute("SELECT rag_chunk_keys(collection, acl, tsv),"
                            " pg_temp.old_keys(collection, acl, heading, text) FROM rag_chunks").fetchall()
        for heading, body in (("The Heading", "Runs running ran; E-VCF-017 x"), (None, ""), ("", "a the of")):
            same = conn.execute(f"SELECT rag_chunk_keys('c', '{{a,b}}', {tsv})"
                                " = pg_temp.old_keys('c', '{a,b}', %(h)s, %(b)s)",
                                {"h": heading, "b": body}).fetchone()[0]
            assert same, (heading, body)
    assert rows and all(new == old and len(new) > 3 for new, old in rows)


def _candidate_scans(dsn: str, collection: str, tokens: list[str]) -> tuple[int, int]:
    """(candidates, scans of the collection's keyword index) of rag_keyword_candidates for the word 'alpha'."""
    with psycopg.connect(dsn) as conn, conn.transaction():  # the scan counts of this transaction
        keys = conn.execute("SELECT array_agg(tag || ':alpha') FROM rag_keyword_domains"
                            " WHERE collection = %s AND acl && %s::text[]", (collection, tokens)).fetchone()[0]
        found = len(conn.execute("SELECT * FROM rag_keyword_candidates(%s, %s::text[], %s::text[])",
                                 (collection, tokens, keys)).fetchall())
        scans = conn.execute("SELECT coalesce(pg_stat_get_xact_numscans(to_regclass(%s)), -1)",
                             (keyword_index_name(collection),)).fetchone()[0]
    return found, int(scans)


def test_keyword_search_reads_the_collection_index_once_loaded_and_readable_chunks_before(pg_dsn):
    store = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=4)
    for d in range(12):
        store.replace_document(*_doc(d))
    store.flush()
    assert _candidate_scans(pg_dsn, "lab", ["group:g1"]) == (sum(1 + d % 4 for d in range(1, 12, 3)), -1)
    during = {tokens: store.keyword_search("alpha part", 50, [tokens]) for tokens in ("group:g0", "group:g1")}
    assert all(during.values()) and during["group:g0"] != during["group:g1"]
    store.save()  # builds the keyword index
    assert _candidate_scans(pg_dsn, "lab", ["group:g1"]) == (sum(1 + d % 4 for d in range(1, 12, 3)), 1)
    after = {tokens: store.keyword_search("alpha part", 50, [tokens]) for tokens in ("group:g0", "group:g1")}
    assert after == during
    store.close()


def test_a_database_of_schema_4_migrates_with_its_loaded_and_half_loaded_collections(pg_dsn, monkeypatch):
    from retrieval.stores.pgvector import schema as pg_schema

    monkeypatch.setattr(pg_schema, "SCHEMA_STEPS",  # the schema as it was at version 4
                        dataclasses.replace(pg_schema.SCHEMA_STEPS, migrations=pg_schema.MIGRATIONS[:4]))
    monkeypatch.setattr(bulk, "create_keyword_index", lambda conn, physical: None)  # schema 4 had none
    monkeypatch.setattr(bulk, "keyword_index_exists", lambda conn, physical: True)
    done = open_for_ingest(pg_dsn, "done", SPEC, batch_documents=4)
    half = open_for_ingest(pg_dsn, "half", SPEC, batch_documents=4)
    for d in range(10):
        done.replace_document(*_doc(d))
        half.replace_document(*_doc(d))
    done.save()
    half.flush()
    half._session.close()  # killed mid-load: no HNSW index
    done.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert hnsw_index_exists(conn, "done") and not hnsw_index_exists(conn, "half")
        kw = conn.execute("SELECT id, kw FROM rag_chunks ORDER BY id").fetchall()
        matched = conn.execute(  # what schema 4's keyword index found for 'alpha' in two domains
            "SELECT id FROM rag_chunks WHERE kw && (SELECT array_agg(tag || ':alpha') FROM rag_keyword_domains"
            " WHERE collection = 'done' AND acl && '{group:g1,group:g2}') ORDER BY id").fetchall()
    monkeypatch.undo()

    resumed = open_for_ingest(pg_dsn, "half", SPEC, batch_documents=4)  # migrates to the latest
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT id, rag_chunk_keys(collection, acl, tsv) FROM rag_chunks ORDER BY id"
                            ).fetchall() == kw
        assert conn.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = 'rag_chunks'"
                            " AND column_name = 'kw'").fetchone()[0] == 0
        assert keyword_index_exists(conn, "done") and keyword_index_exists(conn, "half")
    resumed.replace_document(*_doc(10))
    resumed.save()  # the half-loaded collection gets its HNSW index when its load ends
    assert _has_index(pg_dsn, "half")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT id FROM rag_keyword_candidates('done', '{group:g1,group:g2}', (SELECT array_agg(tag || ':alpha')"
            " FROM rag_keyword_domains WHERE collection = 'done' AND acl && '{group:g1,group:g2}')) ORDER BY id"
        ).fetchall() == matched and len(matched) > 5
    assert _candidate_scans(pg_dsn, "done", ["group:g1"])[1] == 1
    again = open_collection(pg_dsn, "done")
    assert {i for i, _ in again.keyword_search("alpha", 50, ["group:g1", "group:g2"])} == {i for i, in matched}
    again.close()
    resumed.close()


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from tests.retrieval.test_pg_bulk_writes import SPEC, _doc
    from retrieval.stores.pgvector.rebuild import open_for_ingest

    dsn, n = sys.argv[1], int(sys.argv[2])
    store = open_for_ingest(dsn, "lab", SPEC, batch_documents=25)
    done = store.document_states()  # what a resumed ingest skips: stored with the same hash
    for d in range(n):
        doc = _doc(d)
        if doc[0].key not in done or done[doc[0].key].content_hash != doc[0].content_hash:
            store.replace_document(*doc)
    store.save()
    store.finish()
    store.close()
""")


def _writer(dsn: str, n: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", WRITER, dsn, str(n), str(ROOT)], env=env,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_loader_killed_mid_load_resumes_to_the_rows_of_a_clean_run(pg_server, pg_dsn):
    n = 1500
    with fresh_database(pg_server) as clean_dsn:
        clean = _writer(clean_dsn, n)
        assert clean.wait(timeout=300) == 0, clean.stderr.read()
        want = _rows(clean_dsn)

    proc = _writer(pg_dsn, n)
    started = time.monotonic()
    try:
        while True:  # kill once the first batch committed, with the load still going
            assert proc.poll() is None, "the writer finished before it could be killed: raise n"
            assert time.monotonic() - started < 120, "no batch committed"
            try:
                if _count(pg_dsn, "lab") >= 25:
                    break
            except psycopg.Error:
                pass  # the writer has not created the tables yet
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    at_kill = _count(pg_dsn, "lab")
    assert 25 <= at_kill < n and at_kill % 25 == 0  # whole batches only
    assert not _has_index(pg_dsn, "lab")

    again = _writer(pg_dsn, n)
    assert again.wait(timeout=300) == 0, again.stderr.read()
    got = _rows(pg_dsn)
    assert got[0] == want[0]  # chunk ids, text, heading, ACL, vectors, keyword columns
    assert got[1] == want[1]
    assert got[2] == want[2] and any("rag_hnsw_" in name for name, _ in got[2])
