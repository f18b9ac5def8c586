"""The pgvector store against a real PostgreSQL: schema, writes under concurrency, filtered search, failures."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from rag.errors import NotFoundError, StoreError
from rag.types import Chunk, Document
from retrieval.stores.pgvector.collection import (
    PgvectorCollection,
    chunk_id,
    create_collection,
    drop_collection,
    list_collections,
    open_collection,
)
from retrieval.stores.pgvector.schema import LATEST, MIGRATIONS, migrate

DIM = 16


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _write(coll: PgvectorCollection, key: str, acl: set[str], texts: list[str], vectors: np.ndarray,
           content_hash: str | None = None) -> None:
    doc = Document(key=key, source=f"/lab/{key}.md", text="\n".join(texts), content_hash=content_hash or f"h-{key}",
                   acl=frozenset(acl), title=f"Title {key}", metadata={"kind": "note"})
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split()), heading=f"H{i}",
                    metadata={"page": i}) for i, t in enumerate(texts)]
    coll.replace_document(doc, frozenset(acl), chunks, vectors)


def _scalar(dsn: str, query: str, params: tuple = ()) -> object:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchone()[0]


@pytest.fixture
def coll(pg_dsn):
    c = create_collection(pg_dsn, "lab", "test-embedder", "fp-1", DIM, {"max_tokens": 64})
    yield c
    c.close()


# -- schema ----------------------------------------------------------------------------


def test_migrate_is_idempotent_under_concurrent_callers(pg_dsn):
    barrier = threading.Barrier(4)
    results: list[object] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(migrate(pg_dsn))
        except Exception as e:  # collected: a failure in a thread must fail the test
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [LATEST] * 4
    assert migrate(pg_dsn) == LATEST
    assert _scalar(pg_dsn, "SELECT count(*) FROM rag_schema_version") == len(MIGRATIONS)
    assert _scalar(pg_dsn, "SELECT to_regclass('rag_chunks') IS NOT NULL") is True


def test_missing_pgvector_without_privilege_says_what_to_run(pg_dsn):
    role, db = "rag_plain_user", "rag_no_vector"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'plain'")
        admin.execute(f"CREATE DATABASE {db} OWNER {role} TEMPLATE template0")
    try:
        with pytest.raises(StoreError, match=r"CREATE EXTENSION vector.*superuser"):
            migrate(make_conninfo(pg_dsn, dbname=db, user=role, password="plain"))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {db} WITH (FORCE)")
            admin.execute(f"DROP ROLE {role}")


# -- writes and reads ------------------------------------------------------------------


def test_round_trip_and_deterministic_ids(coll):
    rng = np.random.default_rng(0)
    va, vb = _unit(rng, 3), _unit(rng, 2)
    _write(coll, "a", {"user:alice", "group:lab"}, ["alpha one", "alpha two", "alpha three"], va)
    _write(coll, "b", {"public"}, ["beta one", "beta two"], vb)

    rows = coll.dump()
    assert [(r["key"], r["index"]) for r in rows] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert rows[0] | {"vector": None} == {"key": "a", "hash": "h-a", "acl": ["group:lab", "user:alice"],
                                          "title": "Title a", "index": 0, "text": "alpha one", "heading": "H0",
                                          "vector": None}
    assert np.array_equal(np.stack([r["vector"] for r in rows]), np.concatenate([va, vb]))
    assert coll.stats() == {"documents": 2, "chunks": 5}
    states = coll.document_states()
    assert (states["a"].content_hash, states["a"].acl, states["a"].num_chunks) == (
        "h-a", frozenset({"user:alice", "group:lab"}), 3)

    ids = [chunk_id("lab", "a", i) for i in range(3)]
    records = coll.chunk_records(ids + [12345])
    assert set(records) == set(ids)
    rec = records[ids[1]]
    assert (rec.document_key, rec.source, rec.title, rec.index, rec.text, rec.heading) == (
        "a", "/lab/a.md", "Title a", 1, "alpha two", "H1")
    # Writing the same document again is idempotent: same ids, same rows.
    _write(coll, "a", {"user:alice", "group:lab"}, ["alpha one", "alpha two", "alpha three"], va)
    assert coll.chunk_records(ids).keys() == set(ids)
    assert coll.stats() == {"documents": 2, "chunks": 5}


def test_replace_with_fewer_chunks_removes_the_old_ones(coll, pg_dsn):
    rng = np.random.default_rng(1)
    _write(coll, "a", {"public"}, [f"old {i}" for i in range(5)], _unit(rng, 5))
    _write(coll, "a", {"public"}, ["new 0", "new 1"], _unit(rng, 2))
    assert [r["text"] for r in coll.dump()] == ["new 0", "new 1"]
    assert coll.chunk_records([chunk_id("lab", "a", i) for i in range(2, 5)]) == {}
    assert _scalar(pg_dsn, "SELECT count(*) FROM rag_chunks") == 2
    assert coll.stats() == {"documents": 1, "chunks": 2}


def test_set_acl_changes_visibility_not_vectors(coll):
    rng = np.random.default_rng(2)
    _write(coll, "a", {"user:alice"}, ["the BRCA1 assay", "freezer log"], _unit(rng, 2))
    q = _unit(rng, 1)[0]
    before = coll.search(q, 5, ["user:alice"], exact=True)
    vectors = [r["vector"] for r in coll.dump()]
    assert len(before) == 2 and coll.search(q, 5, ["user:bob"]) == []

    coll.set_acl("a", frozenset({"user:bob"}))
    assert coll.search(q, 5, ["user:alice"]) == []
    assert coll.keyword_search("BRCA1", 5, ["user:alice"]) == []
    assert coll.search(q, 5, ["user:bob"], exact=True) == before  # same ids, same scores
    assert len(coll.keyword_search("BRCA1", 5, ["user:bob"])) == 1
    assert all(np.array_equal(a, r["vector"]) for a, r in zip(vectors, coll.dump(), strict=True))
    assert coll.document_states()["a"].acl == frozenset({"user:bob"})
    with pytest.raises(NotFoundError, match="missing"):
        coll.set_acl("missing", frozenset({"public"}))


def test_the_readable_count_is_reused_per_token_set_and_forgotten_on_writes(coll, monkeypatch):
    # The exact-or-graph decision counts readable chunks; at 1M chunks that COUNT was most of a
    # search's time, so it is reused per token set, and any write of this collection forgets it.
    rng = np.random.default_rng(5)
    _write(coll, "a", {"group:alpha"}, ["one", "two"], _unit(rng, 2))
    counts: list[tuple[str, ...]] = []
    real = coll._count_readable
    monkeypatch.setattr(coll, "_count_readable", lambda conn, tokens, stop: counts.append(tuple(tokens))
                        or real(conn, tokens, stop))
    q = _unit(rng, 1)[0]
    first = coll.search(q, 5, ["group:alpha"])
    assert coll.search(q, 5, ["group:alpha"]) == first and len(first) == 2
    assert coll.search(q, 5, ["group:beta"]) == []
    assert counts == [("group:alpha",), ("group:beta",)]  # once per token set
    _write(coll, "b", {"group:beta"}, ["three"], _unit(rng, 1))
    assert len(coll.search(q, 5, ["group:beta"])) == 1  # the write forgot the count of zero
    coll.set_acl("b", frozenset({"group:alpha"}))
    assert coll.search(q, 5, ["group:beta"]) == [] and len(coll.search(q, 5, ["group:alpha"])) == 3
    assert counts[2:] == [("group:beta",), ("group:beta",), ("group:alpha",)]


def test_delete_document_and_collection_listing(coll, pg_dsn):
    rng = np.random.default_rng(3)
    _write(coll, "a", {"public"}, ["one", "two"], _unit(rng, 2))
    _write(coll, "b", {"public"}, ["three"], _unit(rng, 1))
    other = create_collection(pg_dsn, "other", "test-embedder", "fp-1", 8, {})
    other.close()
    assert list_collections(pg_dsn) == {"lab": {"documents": 2, "chunks": 3},
                                        "other": {"documents": 0, "chunks": 0}}
    coll.delete_document("a")
    coll.delete_document("never-there")
    assert coll.stats() == {"documents": 1, "chunks": 1}
    assert [r["key"] for r in coll.dump()] == ["b"]
    drop_collection(pg_dsn, "other")
    with pytest.raises(NotFoundError, match="collections: lab"):
        open_collection(pg_dsn, "other")
    assert _scalar(pg_dsn, "SELECT count(*) FROM pg_indexes WHERE indexname LIKE 'rag_hnsw_%%'") == 1


# -- dense search ----------------------------------------------------------------------


def test_exact_search_equals_numpy_filtered_topk(coll):
    rng = np.random.default_rng(4)
    tokens = ["user:alice", "user:bob", "group:a", "group:b", "public"]
    written: dict[int, tuple[frozenset[str], np.ndarray]] = {}
    for d in range(40):
        acl = set(rng.choice(tokens, size=int(rng.integers(1, 3)), replace=False).tolist())
        vecs = _unit(rng, int(rng.integers(1, 5)))
        _write(coll, f"d{d:02d}", acl, [f"text {d} {i}" for i in range(len(vecs))], vecs)
        for i, v in enumerate(vecs):
            written[chunk_id("lab", f"d{d:02d}", i)] = (frozenset(acl), v)
    ids = np.array(list(written), dtype=np.int64)
    mat = np.stack([v for _, v in written.values()])
    for trial in range(20):
        who = rng.choice(tokens, size=int(rng.integers(1, 3)), replace=False).tolist()
        q, k = _unit(rng, 1)[0], int(rng.integers(1, 30))
        scores = mat @ q
        allowed = [j for j, (acl, _) in enumerate(written.values()) if acl & set(who)]
        want = sorted(((int(ids[j]), float(scores[j])) for j in allowed), key=lambda r: (-r[1], r[0]))[:k]
        got = coll.search(q, k, who, exact=True)
        assert [i for i, _ in got] == [i for i, _ in want], trial
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
    assert coll.search(_unit(rng, 1)[0], 5, []) == []


@pytest.mark.slow
def test_iterative_scan_returns_k_hits_for_a_1_percent_principal(pg_dsn):
    # Seq and bitmap scans and sorts off: the planner must use the HNSW index even for a selective
    # filter (on so small a table it would rightly prefer the ACL's GIN index, or, once the
    # table is analyzed, reading the 20 readable rows by the collection's B-tree and sorting them).
    forced = make_conninfo(pg_dsn, options="-c enable_seqscan=off -c enable_bitmapscan=off -c enable_sort=off")
    rng = np.random.default_rng(5)
    dim, docs, per_doc = 16, 200, 10
    # exact_below=0: never take the exact shortcut for selective filters, test the graph scan
    coll = create_collection(forced, "big", "test-embedder", "fp-1", dim, {}, ef_search=20, exact_below=0)
    rare: list[int] = []
    for d in range(docs):
        acl = {"user:rare"} if d % 100 == 7 else {"group:all"}  # 1% of the 2,000 chunks
        _write(coll, f"d{d:03d}", acl, [f"t{i}" for i in range(per_doc)], _unit(rng, per_doc, dim))
        if "user:rare" in acl:
            rare += [chunk_id("big", f"d{d:03d}", i) for i in range(per_doc)]
    coll.flush()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ANALYZE rag_chunks")  # as autovacuum would, at a moment of its own choosing
    q = _unit(rng, 1, dim)[0]
    assert "Index Scan using rag_hnsw_" in coll.search_plan(q, 10, ["user:rare"])

    got = coll.search(q, 10, ["user:rare"])
    assert len(got) == 10 and {i for i, _ in got} <= set(rare)
    assert coll.num_fallbacks == 0  # the iterative scan itself found them, ef_search=20 notwithstanding
    exact = coll.search(q, 10, ["user:rare"], exact=True)
    assert len({i for i, _ in got} & {i for i, _ in exact}) >= 8
    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)
    coll.close()

    # An iterative scan cut short falls back to the exact search: still k hits.
    short = open_collection(forced, "big", ef_search=20, max_scan_tuples=50, exact_below=0)
    assert short.search(q, 10, ["user:rare"]) == exact
    assert short.num_fallbacks == 1
    short.close()

    # By default a principal who may read this few chunks is answered exactly, without the graph.
    default = open_collection(forced, "big", ef_search=20)
    assert default.search(q, 10, ["user:rare"]) == exact
    assert default.num_fallbacks == 0
    default.close()


# -- keyword search --------------------------------------------------------------------


def test_keyword_search_finds_identifiers_only_in_readable_chunks(coll):
    rng = np.random.default_rng(6)
    _write(coll, "slurm", {"group:hpc"}, ["Jobs fail with QOSMaxGRESPerJob when asking for 8 GPUs",
                                          "unrelated text about storage quotas"], _unit(rng, 2))
    _write(coll, "genes", {"group:genomics"}, ["BRCA1 variant calls from sample E-VCF-017",
                                               "QOSMaxGRESPerJob also appears here"], _unit(rng, 2))
    slurm0, genes0, genes1 = chunk_id("lab", "slurm", 0), chunk_id("lab", "genes", 0), chunk_id("lab", "genes", 1)

    assert [i for i, _ in coll.keyword_search("what is QOSMaxGRESPerJob?", 5, ["group:hpc"])] == [slurm0]
    assert coll.keyword_search("BRCA1", 5, ["group:hpc", "public"]) == []
    assert [i for i, _ in coll.keyword_search("BRCA1", 5, ["group:genomics"])] == [genes0]
    assert [i for i, _ in coll.keyword_search("sample E-VCF-017", 5, ["group:genomics"])] == [genes0]
    # Any word matches (OR); a chunk matching more words ranks first.
    both = coll.keyword_search("BRCA1 QOSMaxGRESPerJob variant", 5, ["group:genomics", "group:hpc"])
    assert [i for i, _ in both][0] == genes0 and {i for i, _ in both} == {slurm0, genes0, genes1}
    assert all(a[1] >= b[1] for a, b in zip(both, both[1:], strict=False))
    # Query syntax is plain text; no usable words means no hits.
    assert [i for i, _ in coll.keyword_search("BRCA1 & !(x | y):* <->", 5, ["group:genomics"])] == [genes0]
    assert coll.keyword_search("the of and ?!", 5, ["group:genomics"]) == []
    assert coll.keyword_search("BRCA1", 5, []) == []


# -- concurrency and failures ----------------------------------------------------------


def test_concurrent_writers_leave_exactly_one_copy_of_each_document(pg_dsn):
    writers, keys, rounds = 4, [f"doc{d}" for d in range(8)], 3
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(w: int) -> None:
        rng = np.random.default_rng(100 + w)
        try:
            barrier.wait()  # every writer also races to create the collection
            mine = create_collection(pg_dsn, "shared", "test-embedder", "fp-1", DIM, {})
        except BaseException as e:
            errors.append(e)
            return
        try:
            for r in range(rounds):
                for key in keys:  # every writer writes every key: maximal overlap
                    n = 1 + (w + r + len(key)) % 4
                    tag = f"w{w}r{r}"
                    _write(mine, key, {"public"}, [f"{tag} {key} {i}" for i in range(n)], _unit(rng, n), tag)
        except BaseException as e:
            errors.append(e)
        finally:
            mine.close()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    coll = open_collection(pg_dsn, "shared")
    rows = coll.dump()
    states = coll.document_states()
    assert set(states) == set(keys)
    for key in keys:
        mine = [r for r in rows if r["key"] == key]
        tag = states[key].content_hash  # the winning write
        assert [r["index"] for r in mine] == list(range(states[key].num_chunks)), key
        assert all(r["text"].startswith(f"{tag} ") for r in mine), key
    assert _scalar(pg_dsn, "SELECT count(*) FROM rag_chunks") == len(rows) == coll.stats()["chunks"]
    coll.close()


def test_bad_dsn_names_it_without_the_password():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dsn = f"postgresql://rag:s3cret@127.0.0.1:{port}/rag"
    with pytest.raises(StoreError) as info:
        open_collection(dsn, "lab")
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "s3cret" not in message and "***" in message
    assert "rag db start" in message


def test_embedder_mismatch_and_wrong_dimensions(coll, pg_dsn):
    with pytest.raises(StoreError, match="new collection"):
        create_collection(pg_dsn, "lab", "other-embedder", "fp-2", DIM, {})
    with pytest.raises(StoreError, match=r"16 dims.*32 dims"):
        open_collection(pg_dsn, "lab", embedder="test-embedder", fingerprint="fp-1", dim=32)
    same = create_collection(pg_dsn, "lab", "test-embedder", "fp-1", DIM, {})  # reopening is fine
    same.close()

    rng = np.random.default_rng(7)
    with pytest.raises(StoreError, match=f"{DIM}-dim"):
        _write(coll, "a", {"public"}, ["x", "y"], _unit(rng, 2, DIM + 1))
    with pytest.raises(StoreError, match="NaN"):
        _write(coll, "a", {"public"}, ["x"], np.full((1, DIM), np.nan, dtype=np.float32))
    with pytest.raises(StoreError, match=f"has {DIM}"):
        coll.search(_unit(rng, 1, DIM + 1)[0], 3, ["public"])
    assert coll.stats() == {"documents": 0, "chunks": 0}


def _terminate_others(dsn: str, waiting_on_lock: bool) -> int:
    """Kill the backends of this database other than ours; with `waiting_on_lock`, only a blocked one."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        for _ in range(200):
            pids = [r[0] for r in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' AND (NOT %s OR wait_event_type = 'Lock')",
                (waiting_on_lock,))]
            if pids:
                admin.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
                return len(pids)
            time.sleep(0.05)
    raise AssertionError("no backend to terminate")


def test_dropped_connection_mid_write_leaves_the_old_document(coll, pg_dsn):
    rng = np.random.default_rng(8)
    old_vectors = _unit(rng, 3)
    _write(coll, "a", {"public"}, ["old 0", "old 1", "old 2"], old_vectors)
    old = coll.dump()

    # A second session holds the old chunks' row locks: the writer gets past the document row,
    # then waits on DELETE of the chunks, where its backend is terminated.
    with psycopg.connect(pg_dsn) as locker:
        locker.execute("SELECT 1 FROM rag_chunks WHERE document_key = 'a' FOR UPDATE")
        failure: list[BaseException] = []

        def write_new() -> None:
            try:
                _write(coll, "a", {"group:x"}, [f"new {i}" for i in range(5)], _unit(rng, 5))
            except BaseException as e:
                failure.append(e)

        writer = threading.Thread(target=write_new)
        writer.start()
        _terminate_others(pg_dsn, waiting_on_lock=True)
        writer.join(timeout=30)
        locker.rollback()
    assert len(failure) == 1 and isinstance(failure[0], StoreError)
    assert "lost the connection" in str(failure[0])

    # The next calls reconnect; the document is the old one, whole.
    dumped = coll.dump()
    assert [(r["key"], r["text"], r["acl"]) for r in dumped] == [(r["key"], r["text"], r["acl"]) for r in old]
    assert np.array_equal(np.stack([r["vector"] for r in dumped]), old_vectors)
    assert coll.stats() == {"documents": 1, "chunks": 3}
    _write(coll, "a", {"group:x"}, [f"new {i}" for i in range(5)], _unit(rng, 5))
    assert [r["text"] for r in coll.dump()] == [f"new {i}" for i in range(5)]


def test_connection_dropped_while_idle_is_replaced_on_the_next_call(coll, pg_dsn):
    rng = np.random.default_rng(9)
    _write(coll, "a", {"public"}, ["one"], _unit(rng, 1))
    _terminate_others(pg_dsn, waiting_on_lock=False)
    assert coll.stats() == {"documents": 1, "chunks": 1}  # a read reconnects
    _terminate_others(pg_dsn, waiting_on_lock=False)
    _write(coll, "b", {"public"}, ["two"], _unit(rng, 1))  # so does a write that had not begun
    assert coll.stats() == {"documents": 2, "chunks": 2}


def test_new_documents_commit_asynchronously_but_anything_that_can_revoke_access_is_durable(pg_dsn):
    """synchronous_commit is off for the bulk of an ingest (inserts), on for updates, ACL changes, deletions."""
    durable: list[str] = []

    class Spy(PgvectorCollection):
        def _durable(self, conn: psycopg.Connection) -> None:
            super()._durable(conn)
            durable.append(conn.execute("SHOW synchronous_commit").fetchone()[0])

    info = create_collection(pg_dsn, "lab", "test-embedder", "fp-1", DIM, {"max_tokens": 64}).info
    coll = Spy(pg_dsn, info)
    rng = np.random.default_rng(3)
    assert coll._connection().execute("SHOW synchronous_commit").fetchone()[0] == "off"
    _write(coll, "a", {"group:x"}, ["one"], _unit(rng, 1))
    assert durable == []  # a new document: no flush wait
    _write(coll, "a", {"group:y"}, ["one", "two"], _unit(rng, 2), content_hash="h-a2")  # an update
    coll.set_acl("a", frozenset({"group:z"}))
    coll.delete_document("a")
    assert durable == ["on", "on", "on"]
    assert coll._connection().execute("SHOW synchronous_commit").fetchone()[0] == "off"  # SET LOCAL only
    coll.close()
    strict = PgvectorCollection(pg_dsn, info, durable_commits=True)  # leaves the server's setting alone
    assert strict._connection().execute("SHOW synchronous_commit").fetchone()[0] == _scalar(
        pg_dsn, "SHOW synchronous_commit")
    strict.close()
