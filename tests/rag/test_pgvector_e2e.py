"""The whole pipe on PostgreSQL + pgvector: the sample corpus gives what the embedded default gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.rag.conftest import DEMO_USERS, REPO


@pytest.fixture(scope="module")
def pg_lab(tmp_path_factory, rag_factory, lab_copy, pg_server):
    from tests.pg_fixture import fresh_database

    with fresh_database(pg_server) as dsn:
        rag = rag_factory(tmp_path_factory.mktemp("pg-home"), store="pgvector", dsn=dsn)
        report = rag.ingest([lab_copy])
        assert report.ok, report.problems
        for user, groups in DEMO_USERS.items():
            rag.identity.add_user(user, groups)
        yield rag, dsn, report
        rag.close()


def test_same_collection_and_answers_as_faiss(pg_lab, lab_rag):
    pg, _, report = pg_lab
    assert pg.collection().stats() == lab_rag.collection().stats()
    assert report.added == lab_rag.collection().stats()["documents"]
    questions = [json.loads(line) for line in (REPO / "examples" / "questions.jsonl").read_text().splitlines()
                 if line.strip()]
    for q in questions[:12]:
        for mode in ("dense", "keyword", "hybrid"):
            user = q.get("user") or q.get("as")
            a = pg.query(q["question"], pg.principal(user), k=5, generate=False, rerank=False, mode=mode)
            b = lab_rag.query(q["question"], lab_rag.principal(user), k=5, generate=False, rerank=False, mode=mode)
            if mode == "dense":  # exact on both sides (few readable chunks): same ranking
                assert [h.text for h in a.hits] == [h.text for h in b.hits], q["question"]
            for h in a.hits:
                assert pg.principal(user).can_read(h.acl)


def test_reingest_is_a_no_op(pg_lab, lab_copy):
    pg, _, _ = pg_lab
    again = pg.ingest([lab_copy])
    assert again.added == again.updated == again.deleted == again.acl_updated == 0 and again.unchanged > 0
    assert again.chunks_written == 0


def test_acl_change_applies_without_reembedding(pg_lab, tmp_path):
    pg, _, _ = pg_lab
    tree = tmp_path / "acl-tree"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["group:genomics"]\n')
    (tree / "plan.md").write_text("# Plan\n\nThe sequencer service visit is booked for Tuesday 9 December.\n")
    first = pg.ingest([tree], collection="acl-change")
    assert first.added == 1
    question = "When is the sequencer service visit?"
    bob, alice = pg.principal("bob"), pg.principal("alice")
    assert not pg.query(question, bob, collection="acl-change", generate=False, rerank=False).hits
    assert pg.query(question, alice, collection="acl-change", generate=False, rerank=False).hits
    (tree / ".rag-acl.toml").write_text('allow = ["group:imaging"]\n')  # genomics loses it, imaging gains it
    report = pg.ingest([tree], collection="acl-change")
    assert report.acl_updated == 1 and report.chunks_written == 0 and report.tokens_embedded == 0
    hits = pg.query(question, bob, collection="acl-change", generate=False, rerank=False).hits
    assert hits and "9 December" in hits[0].text
    assert not pg.query(question, alice, collection="acl-change", generate=False, rerank=False).hits


@pytest.mark.slow
def test_cli_over_pgvector(pg_lab, lab_copy, tmp_path):
    pg, dsn, _ = pg_lab
    env_home = pg.settings.home  # chunks, users and keys all live in PostgreSQL (store = pgvector)
    cmd = [sys.executable, "-c", "from rag.cli import main; main()"]
    out = subprocess.run(
        [*cmd, "--home", str(env_home), "query", "Which GPU nodes can I use?", "--as", "dave",
         "--store", "pgvector", "--dsn", dsn, "--no-generate", "--no-rerank", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["citations"] and all("/public/" in c["source"] for c in body["citations"])
    bad = subprocess.run(
        [*cmd, "--home", str(env_home), "collections", "--store", "pgvector",
         "--dsn", "postgresql://nobody@127.0.0.1:1/none"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2
    assert "cannot connect" in bad.stderr and "rag db start" in bad.stderr
    none = subprocess.run([*cmd, "--home", str(env_home), "collections", "--store", "pgvector"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert none.returncode == 2 and "rag db start" in none.stderr
