"""The HNSW graph of the pgvector store (pg_hnsw_m, pg_hnsw_ef_construction): read back from the server's index."""

from __future__ import annotations

import logging

import numpy as np
import psycopg
import pytest

from rag.errors import ConfigError
from rag.pipeline import Rag
from rag.settings import Settings
from rag.types import Chunk, Document
from retrieval.records import BuildSpec
from retrieval.stores.pgvector.bulk import index_memory_mb
from retrieval.stores.pgvector.collection import PgvectorCollection, create_collection
from retrieval.stores.pgvector.rebuild import PgvectorBuild, open_for_ingest
from retrieval.stores.pgvector.schema import HnswParams, hnsw_index_name, hnsw_index_options

DIM = 8
SPEC = BuildSpec("test-embedder", "fp-1", DIM, {"max_tokens": 64})


def _doc(d: int, version: str = "v1"):
    rng = np.random.default_rng(d)
    key = f"doc{d:04d}"
    texts = [f"{version} {key} part {i}" for i in range(3)]
    vectors = rng.standard_normal((len(texts), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    acl = frozenset({"group:lab"})
    doc = Document(key=key, source=f"/lab/{key}.md", text="\n".join(texts), content_hash=f"{version}-{d}", acl=acl)
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=4) for i, t in enumerate(texts)]
    return doc, acl, chunks, vectors


def _graph(dsn: str, physical: str) -> tuple[dict[str, str], str] | None:
    """The options of generation `physical`'s HNSW index as the server stores them (pg_class.reloptions),
    and its definition (pg_indexes.indexdef); None when it has no HNSW index."""
    name = hnsw_index_name(physical)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT c.reloptions, i.indexdef FROM pg_class c"
                           " JOIN pg_indexes i ON i.indexname = c.relname WHERE c.relname = %s", (name,)).fetchone()
    if row is None:
        return None
    return dict(o.split("=", 1) for o in row[0] or []), row[1]


def _rag(tmp_path, dsn: str, **settings: int) -> Rag:
    # Through Rag, as `rag ingest` builds its stores: the test fails if any step stops passing them on.
    return Rag(Settings(home=tmp_path, store="pgvector", dsn=dsn, **settings))


def _load(store, docs: range, version: str = "v1") -> None:
    for d in docs:
        store.replace_document(*_doc(d, version))
    store.save()


def test_the_settings_build_the_graph_of_a_new_collection_and_of_its_next_version(pg_dsn, tmp_path, caplog):
    rag = _rag(tmp_path / "a", pg_dsn, pg_hnsw_m=24, pg_hnsw_ef_construction=100)
    try:
        target = rag.stores.for_ingest("big", SPEC)
        assert isinstance(target, PgvectorCollection) and _graph(pg_dsn, "big") is None  # built at the load's end
        _load(target, range(8))
        options, indexdef = _graph(pg_dsn, "big")
        assert options == {"m": "24", "ef_construction": "100"}
        assert "USING hnsw" in indexdef and "WITH (m='24', ef_construction='100')" in indexdef
        query = _doc(3)[3][0]
        assert target.search(query, 1, ["group:lab"])[0][1] == pytest.approx(1.0, abs=1e-5)
    finally:
        rag.close()

    # Other values later: the existing index is left as it was built (and the log says so) ...
    rag = _rag(tmp_path / "b", pg_dsn, pg_hnsw_m=8, pg_hnsw_ef_construction=40)
    try:
        same = rag.stores.for_ingest("big", SPEC)
        with caplog.at_level(logging.INFO, logger="retrieval.stores.pgvector.bulk"):
            _load(same, range(8, 10))
        assert _graph(pg_dsn, "big")[0] == {"m": "24", "ef_construction": "100"}
        assert "keeps the graph it was built with (m 24, ef_construction 100)" in caplog.text
        # ... and the next version of the collection (another embedder) is built with them.
        build = rag.stores.for_ingest("big", BuildSpec("test-embedder", "fp-2", DIM, {"max_tokens": 64}))
        assert isinstance(build, PgvectorBuild)
        _load(build, range(10), version="v2")
        assert build.finish().switched
        assert _graph(pg_dsn, "big@2")[0] == {"m": "8", "ef_construction": "40"}
        assert _graph(pg_dsn, "big") is None  # the old version went, with its index
    finally:
        rag.close()


def test_an_ingest_through_the_open_live_collection_builds_a_missing_graph_with_the_settings(pg_dsn, tmp_path):
    killed = open_for_ingest(pg_dsn, "lab", SPEC, batch_documents=2)
    for d in range(4):
        killed.replace_document(*_doc(d))
    killed._session.close()  # a loader killed before its load ended: no index yet
    rag = _rag(tmp_path, pg_dsn, pg_hnsw_m=12, pg_hnsw_ef_construction=48)
    try:
        live = rag.stores.open("lab")  # a query opened it first (a notebook that searches, then ingests)
        target = rag.stores.for_ingest("lab", SPEC)
        assert target is live
        target.save()
        assert _graph(pg_dsn, "lab")[0] == {"m": "12", "ef_construction": "48"}
    finally:
        rag.close()


def test_a_collection_created_with_its_index_takes_the_values_given_or_the_stores_defaults(pg_dsn):
    store = create_collection(pg_dsn, "made", "test-embedder", "fp-1", DIM, {}, hnsw_m=12, hnsw_ef_construction=50)
    assert _graph(pg_dsn, "made")[0] == {"m": "12", "ef_construction": "50"}
    _load(store, range(3))  # writes after that go into the index incrementally
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert hnsw_index_options(conn, "made") == HnswParams(12, 50)
    store.close()
    plain = create_collection(pg_dsn, "plain", "test-embedder", "fp-1", DIM, {})
    assert _graph(pg_dsn, "plain")[0] == {"m": "16", "ef_construction": "128"}
    plain.close()
    assert Settings().pg_hnsw_m == HnswParams.m and Settings().pg_hnsw_ef_construction == HnswParams.ef_construction


def test_an_index_made_before_the_options_reads_as_pgvectors_defaults(pg_dsn):
    store = create_collection(pg_dsn, "old", "test-embedder", "fp-1", DIM, {})
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        name = hnsw_index_name("old")
        conn.execute(f'DROP INDEX "{name}"')  # as the store made it before: no WITH clause
        conn.execute(f"CREATE INDEX \"{name}\" ON rag_chunks USING hnsw ((embedding::vector({DIM})) vector_ip_ops)"
                     " WHERE collection = 'old'")
        assert hnsw_index_options(conn, "old") == HnswParams(16, 64)
        assert hnsw_index_options(conn, "missing") is None
    store.close()


@pytest.mark.parametrize(("m", "ef", "message"), [
    (1, 64, "m must be a whole number from 2 to 100, got 1"),
    (101, 1000, "m must be a whole number from 2 to 100"),
    (16, 1001, "ef_construction must be a whole number from 4 to 1000"),
    (32, 63, "ef_construction must be at least 2 x m = 64"),
    (True, 64, "m must be a whole number"),
])
def test_graph_values_out_of_pgvectors_bounds_are_refused_before_anything_is_created(pg_dsn, m, ef, message):
    with pytest.raises(ConfigError, match=message):
        create_collection(pg_dsn, "bad", "test-embedder", "fp-1", DIM, {}, hnsw_m=m, hnsw_ef_construction=ef)
    with pytest.raises(ConfigError, match=message):
        open_for_ingest(pg_dsn, "bad", SPEC, hnsw_m=m, hnsw_ef_construction=ef)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('rag_collections') IS NULL").fetchone()[0]  # not even migrated


def test_the_index_memory_estimate_grows_with_m():
    assert index_memory_mb(1_000_000, 384, 1 << 20, m=32) > index_memory_mb(1_000_000, 384, 1 << 20, m=16)
    assert index_memory_mb(1_000_000, 384, 1 << 20) == index_memory_mb(1_000_000, 384, 1 << 20, m=16)
