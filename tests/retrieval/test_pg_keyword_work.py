"""pgvector's keyword leg: its work depends only on what the principal may read (issue 13).

Work is read from EXPLAIN (ANALYZE, BUFFERS) of the search statement itself, never timed:
the rows every plan node produced and the pages it touched. Two databases hold the same
readable chunks and the same 1,500 unreadable ones; in one of them the unreadable chunks
contain the searched identifier.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from psycopg import sql

from rag.types import Chunk, Document
from retrieval.stores.pgvector.collection import PgvectorCollection, create_collection
from retrieval.stores.pgvector.schema import keyword_index_name
from tests.pg_fixture import fresh_database

DIM = 8
NUM_HIDDEN = 1500
NUM_FILLER = 3000
QUESTION = "Is ZX-4471 the flux calibration run?"


def _write(coll: PgvectorCollection, key: str, acl: set[str], texts: list[str]) -> None:
    doc = Document(key=key, source=f"/lab/{key}", text="\n".join(texts), content_hash=key, acl=frozenset(acl))
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split())) for i, t in enumerate(texts)]
    vectors = np.ones((len(chunks), DIM), dtype=np.float32) / np.sqrt(DIM)
    coll.replace_document(doc, frozenset(acl), chunks, vectors)


def _fill(dsn: str, hidden_word: str) -> PgvectorCollection:
    coll = create_collection(dsn, "docs", "test-embedder", "fp", DIM, {})
    for i in range(40):
        _write(coll, f"bob{i}", {"user:bob"}, [f"flux calibration note {i} for the beamline"])
    # Bob reads many chunks, few with the terms: a planner left free would rather look the
    # terms up in a word index over every chunk than check each of bob's chunks.
    for d in range(NUM_FILLER // 10):
        _write(coll, f"guide{d}", {"user:bob", "public"}, [f"user guide page {d}-{j}" for j in range(10)])
    for d in range(NUM_HIDDEN // 10):
        # Same length either way ("ZX-4471" / "XQ-9000"), so both tables lay out alike.
        _write(coll, f"secret{d}", {"group:secret"},
               [f"incident {hidden_word} freezer alarm log {d}-{j}" for j in range(10)])
    with coll._connection().cursor() as cur:  # settle both databases alike (visibility map, statistics)
        cur.execute("VACUUM ANALYZE rag_chunks")
    return coll


def _work(plan: dict) -> list[tuple[str, int, int]]:
    """(node type, rows, pages touched) of every plan node, depth first."""
    out = []

    def walk(node: dict) -> None:
        pages = sum(node.get(f"{kind} {what} Blocks", 0)
                    for kind in ("Shared", "Local", "Temp") for what in ("Hit", "Read"))
        out.append((node["Node Type"], int(node["Actual Rows"]), int(pages)))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return out


@pytest.mark.slow
def test_unreadable_matches_cost_a_reader_nothing(pg_server):
    with fresh_database(pg_server) as with_dsn, fresh_database(pg_server) as without_dsn:
        with_term, without = _fill(with_dsn, "ZX-4471"), _fill(without_dsn, "XQ-9000")
        bob = ["public", "user:bob"]
        try:
            assert with_term.keyword_search(QUESTION, 10, bob) == without.keyword_search(QUESTION, 10, bob)
            assert len(with_term.keyword_search(QUESTION, 10, bob)) == 10
            assert _work(with_term.keyword_plan(QUESTION, 10, bob)) == _work(without.keyword_plan(QUESTION, 10, bob))

            # The measurement is not blind: for a reader of the hidden chunks it differs.
            carol = ["group:secret"]
            rows_with = sum(r for _, r, _ in _work(with_term.keyword_plan("ZX-4471", 10, carol)))
            rows_without = sum(r for _, r, _ in _work(without.keyword_plan("ZX-4471", 10, carol)))
            assert rows_with >= rows_without + NUM_HIDDEN

            # As while a bulk load has not built the collection's keyword index yet (migration 5):
            # the fallback computes keys of readable chunks only, so the same holds.
            for coll in (with_term, without):
                with coll._connection().cursor() as cur:
                    cur.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(keyword_index_name(coll.physical))))
            assert with_term.keyword_search(QUESTION, 10, bob) == without.keyword_search(QUESTION, 10, bob)
            assert _work(with_term.keyword_plan(QUESTION, 10, bob)) == _work(without.keyword_plan(QUESTION, 10, bob))
        finally:
            with_term.close()
            without.close()


def test_a_database_from_before_the_split_is_upgraded_with_its_chunks(pg_dsn, monkeypatch):
    """Chunks written under schema 2 get their domain keys and domains when migration 3 runs."""
    from retrieval.stores.pgvector import schema as pg_schema

    monkeypatch.setattr(pg_schema, "SCHEMA_STEPS",  # the schema as it was at version 2
                        dataclasses.replace(pg_schema.SCHEMA_STEPS, migrations=pg_schema.MIGRATIONS[:2]))
    monkeypatch.setattr(pg_schema, "create_keyword_index", lambda conn, physical: None)  # migration 5's
    monkeypatch.setattr(PgvectorCollection, "_add_keyword_domain", lambda self, conn, acl: None)  # as before the split
    old = create_collection(pg_dsn, "docs", "test-embedder", "fp", DIM, {})
    _write(old, "guide", {"public"}, ["the ZX-4471 calibration guide"])
    _write(old, "secret", {"group:secret"}, ["ZX-4471 incident"])
    old.close()
    monkeypatch.undo()

    coll = create_collection(pg_dsn, "docs", "test-embedder", "fp", DIM, {})  # migrates to the latest
    try:
        assert [r for r, _ in coll.keyword_search("ZX-4471", 5, ["public"])] == [
            r for r, _ in coll.keyword_search("calibration", 5, ["public"])]
        assert len(coll.keyword_search("ZX-4471", 5, ["public", "group:secret"])) == 2
        assert coll.keyword_search("incident", 5, ["public"]) == []
    finally:
        coll.close()
