"""The keyword leg's work depends only on what the principal may read (issue 13, timing channel).

Work is counted, never timed: SQLite's progress handler counts virtual-machine steps of every
statement the search runs (one per row an FTS table yields, per join probe, per comparison),
and the authorizer names every table a freshly prepared statement reads, FTS5's own shadow
tables included. A term that appears in 0 or in 1,500 chunks a principal may not read must
cost that principal exactly the same, and must never open those chunks' tables.
"""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from rag.types import Chunk, Document
from retrieval.stores.embedded import keyword_index
from retrieval.stores.embedded.catalog import Catalog

DIM = 4
SECRET_TERM = "ZX-4471"
NUM_HIDDEN = 1500
QUESTION = f"Is {SECRET_TERM} the flux calibration run?"


def _doc(key: str) -> Document:
    return Document(key=key, source=f"/src/{key}", text="", content_hash=key, acl=frozenset())


def _put(catalog: Catalog, key: str, texts: list[str], acl: set[str]) -> None:
    chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split())) for i, t in enumerate(texts)]
    catalog.replace_document("docs", _doc(key), frozenset(acl), chunks,
                             np.ones((len(chunks), DIM), dtype=np.float32))


def _build(path, hidden: str) -> None:
    """Bob's readable chunks, plus 1,500 group:secret chunks that contain the term or not (or none)."""
    catalog = Catalog(path)
    catalog.create_collection("docs", "test-embedder", "fp1", DIM, {})
    for i in range(40):
        _put(catalog, f"bob{i}", [f"flux calibration note {i} for the beamline"], {"user:bob"})
    _put(catalog, "lab", ["the lab flux manual", "calibration schedule"], {"user:bob", "group:lab"})
    if hidden != "none":
        word = SECRET_TERM if hidden == "with-term" else "XQ-9000"
        for d in range(NUM_HIDDEN // 10):
            _put(catalog, f"secret{d}", [f"incident {word} flux calibration log {d}-{j}" for j in range(10)],
                 {"group:secret"})
    catalog.close()


def _work(path, tokens: list[str]) -> tuple[int, set[str], list[tuple[int, float]]]:
    """(VM steps, tables read, results) of one keyword search on a fresh connection."""
    catalog = Catalog(path)
    conn = catalog.conn
    steps = 0
    tables: set[str] = set()

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0  # 0: carry on

    def record(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
        if action == sqlite3.SQLITE_READ and arg1:
            tables.add(arg1)
        return sqlite3.SQLITE_OK

    conn.set_authorizer(record)
    conn.set_progress_handler(count, 1)
    try:
        results = catalog.keyword_search("docs", QUESTION, 10, tokens)
    finally:
        conn.set_progress_handler(None, 1)
        conn.set_authorizer(None)
    catalog.close()
    return steps, tables, results


def _secret_tables(path) -> set[str]:
    catalog = Catalog(path)
    rows = catalog.conn.execute("SELECT id FROM keyword_domains WHERE acl = ?", ('["group:secret"]',)).fetchall()
    catalog.close()
    return {keyword_index.table_name(r[0]) for r in rows}


@pytest.mark.parametrize("baseline", ["without-term", "none"])
def test_unreadable_matches_cost_a_reader_nothing(tmp_path, baseline):
    """0 vs 1,500 unreadable chunks with the term (or none at all): identical work for bob."""
    with_term, without = tmp_path / "with.sqlite", tmp_path / "without.sqlite"
    _build(with_term, "with-term")
    _build(without, baseline)
    bob = ["public", "user:bob"]

    steps_with, tables_with, results_with = _work(with_term, bob)
    steps_without, tables_without, results_without = _work(without, bob)

    assert results_with == results_without and len(results_with) == 10
    assert steps_with == steps_without, "the keyword search did more work because unreadable chunks match"
    assert tables_with == tables_without
    secret = _secret_tables(with_term)
    assert secret and not any(t.startswith(s) for t in tables_with for s in secret)


def test_the_counter_sees_matches_of_readable_chunks(tmp_path):
    """The same measurement for a reader of the 1,500 chunks does differ: the counter is not blind."""
    with_term, without = tmp_path / "with.sqlite", tmp_path / "without.sqlite"
    _build(with_term, "with-term")
    _build(without, "without-term")
    carol = ["group:secret", "public", "user:carol"]
    steps_with, tables_with, results_with = _work(with_term, carol)
    steps_without, _, _ = _work(without, carol)
    assert len(results_with) == 10
    assert steps_with > steps_without + NUM_HIDDEN  # at least one step per matching row
    assert _secret_tables(with_term) <= tables_with
