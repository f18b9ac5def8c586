"""Database faults: the real PostgreSQL server stopped (pg_ctl) in the middle of an ingest and of a
running `rag serve`, then started again.

An ingest stops with an error that names the server (never its password) and says what to do,
leaves no document half-written (checked with SQL after the restart), and a rerun ends with
exactly the rows of a clean run. The service answers 503 (OpenAI shape, Retry-After) on
/v1/query and /v1/chat/completions while the database is away, /readyz says why, and the first
request after the restart succeeds: no restart of the service, no stale connection kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import openai
import psycopg
import pytest

from rag.errors import StoreUnavailable
from rag.local_postgres.server import LocalPostgres
from retrieval.stores.pgvector import rebuild as pg_rebuild
from retrieval.stores.pgvector.schema import mask_dsn
from retrieval.stores.pgvector.session import server_address
from tests.pg_fixture import own_pg_server, server_stopped, start_server, stop_server, with_dbname  # noqa: F401
from tests.rag.conftest import DEMO_USERS, REPO, rag_factory  # noqa: F401 - rag_factory is a fixture
from tests.rag.serve_fixture import running_service
from tests.rag.test_shards import assert_same_collection, corpus  # noqa: F401 - corpus is a fixture

pytestmark = pytest.mark.slow  # real servers, real models, an ingest each

QUESTION = "Which GPU nodes can I use?"
BATCH = 3  # documents per write transaction in the ingest test


def _password(dsn: str) -> str:
    password = unquote(urlsplit(dsn).password or "")
    assert len(password) >= 16, "the test server must use password auth for the leak checks to mean anything"
    return password


def _rows(dsn: str) -> dict[str, set]:
    """Every row of the collection's tables, as sets (what "exactly the same rows" means)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            "documents": set(conn.execute(
                "SELECT collection, key, source, title, content_hash, acl::text, metadata::text, num_chunks"
                " FROM rag_documents").fetchall()),
            "chunks": set(conn.execute(
                "SELECT id, collection, document_key, idx, text, heading, num_tokens, metadata::text, acl::text,"
                " rag_chunk_keys(collection, acl, tsv)::text, tsv::text FROM rag_chunks").fetchall()),
            "keyword_domains": set(conn.execute(
                "SELECT collection, acl::text, tag FROM rag_keyword_domains").fetchall()),
        }


def _half_written(dsn: str) -> list:
    """Documents that are not whole: chunk count, chunk ACLs or keyword domains off, or chunks without one."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("""
            SELECT 'chunks' AS what, d.key FROM rag_documents d
              WHERE d.num_chunks <> (SELECT count(*) FROM rag_chunks c
                                     WHERE c.collection = d.collection AND c.document_key = d.key)
            UNION ALL SELECT 'acl', c.document_key FROM rag_chunks c JOIN rag_documents d
              ON d.collection = c.collection AND d.key = c.document_key WHERE c.acl <> d.acl
            UNION ALL SELECT 'keyword domain', c.document_key FROM rag_chunks c WHERE NOT EXISTS (
              SELECT 1 FROM rag_keyword_domains k WHERE k.collection = c.collection AND k.acl = c.acl)
            UNION ALL SELECT 'vector', c.document_key FROM rag_chunks c WHERE vector_dims(c.embedding) <> 384
        """).fetchall()


def _cli_env(home: Path, dsn: str) -> dict[str, str]:
    return {**os.environ, "RAG_HOME": str(home), "RAG_STORE": "pgvector", "RAG_DSN": dsn, "RAG_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_ingest_stopped_mid_batch_writes_nothing_half_and_a_rerun_equals_a_clean_run(
        own_pg_server: LocalPostgres, rag_factory, corpus, tmp_path, monkeypatch):  # noqa: F811
    server = own_pg_server
    dsn = server.dsn
    password = _password(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE clean")
    clean_dsn = with_dbname(dsn, "clean")
    with psycopg.connect(clean_dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION vector")
    clean = rag_factory(tmp_path / "clean-home", rerank=False, store="pgvector", dsn=clean_dsn)
    assert clean.ingest([corpus], collection="lab").ok
    clean_rows = _rows(clean_dsn)
    assert len(clean_rows["documents"]) >= 5 and clean_rows["chunks"]

    home = tmp_path / "home"
    rag = rag_factory(home, rerank=False, store="pgvector", dsn=dsn)
    # Ingest commits a batch of documents per transaction (retrieval/stores/pgvector/bulk.py): 3 per
    # batch here, so that the corpus takes several and the server can go away between two of them.
    monkeypatch.setattr(pg_rebuild, "DEFAULT_BATCH_DOCUMENTS", BATCH)
    store = rag.collection("lab", create=True)  # the collection the ingest writes to (kept open)
    session = store._session
    real_write = session.write
    batches: list[set[str]] = []  # the documents each batch transaction held before its COMMIT
    port: list[int] = []

    def write(what, fn):
        def fn_then_stop(conn):
            fn(conn)  # every row of the batch is in, not yet committed...
            keys = {k for (k,) in conn.execute("SELECT key FROM rag_documents WHERE collection = 'lab'")}
            batches.append(keys - set().union(*batches))
            if len(batches) == 2:
                port.append(stop_server(server, "fast"))  # ... and the server goes away before COMMIT

        return real_write(what, fn_then_stop if what.startswith("writing ") else fn)

    session.write = write
    with pytest.raises(StoreUnavailable) as err:
        rag.ingest([corpus], collection="lab")
    session.write = real_write
    assert port, "the ingest ended before its second batch: the corpus is too small for this test"
    committed, interrupted = batches
    assert len(committed) == len(interrupted) == BATCH
    message = str(err.value)
    # Names the server (host and port), not its password; says nothing was half-written and what to do.
    assert f"127.0.0.1:{port[0]}" in message and mask_dsn(dsn) in message and password not in message, message
    assert "nothing was half-written" in message and "run the same command again" in message, message
    assert "while writing 3 documents" in message, message

    # The CLI, while the server is still down: a clear error, exit 2, no password anywhere.
    done = subprocess.run([sys.executable, "-m", "rag.cli", "ingest", str(corpus), "--collection", "lab"],
                          cwd=REPO, env=_cli_env(home, dsn), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot connect to PostgreSQL at {mask_dsn(dsn)}" in done.stderr, done.stderr
    assert "rag db start" in done.stderr and password not in done.stdout + done.stderr

    start_server(server, port[0])
    assert _half_written(dsn) == []
    after = _rows(dsn)
    stored = {key for _, key, *_ in after["documents"]}
    assert stored == committed, (stored, committed)  # the first batch, whole; nothing of the second
    assert not any(row[2] in interrupted for row in after["chunks"])
    assert after["documents"] < clean_rows["documents"] and after["chunks"] < clean_rows["chunks"]

    # The same Rag (its session dropped the dead connection) and the same command: resumes, completes.
    report = rag.ingest([corpus], collection="lab")
    assert report.ok and report.unchanged == BATCH and report.added == len(clean_rows["documents"]) - BATCH, report
    assert _half_written(dsn) == []
    assert _rows(dsn) == clean_rows
    assert_same_collection(rag_factory(home, rerank=False, store="pgvector", dsn=dsn, collection="lab"),
                           rag_factory(tmp_path / "clean-home", rerank=False, store="pgvector", dsn=clean_dsn,
                                       collection="lab"), queries=False)
    assert "***" in mask_dsn(dsn) and server_address(dsn) == f"127.0.0.1:{port[0]}/postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:  # the bulk load ended: its HNSW index was built
        assert conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'rag_chunks'"
                            " AND indexdef LIKE '%hnsw%'").fetchone()[0] == 1


@pytest.fixture
def pg_service(own_pg_server: LocalPostgres, rag_factory, corpus, tmp_path):  # noqa: F811
    """`rag serve` (a subprocess) over a pgvector collection on a server the test may stop."""
    dsn = own_pg_server.dsn
    home = tmp_path / "home"
    rag = rag_factory(home, store="pgvector", dsn=dsn)
    try:
        assert rag.ingest([corpus]).ok
        for user, groups in DEMO_USERS.items():
            rag.identity.add_user(user, groups)
        keys = {"bob": rag.identity.create_key("bob", ["imaging"])}
    finally:
        rag.close()
    env = {"RAG_STORE": "pgvector", "RAG_DSN": dsn, "RAG_ANSWER_MODE": "extract"}
    with running_service(home, keys, env) as service:
        yield service, own_pg_server


def _ask(service) -> httpx.Response:
    return httpx.post(f"{service.url}/v1/query", headers=service.auth("bob"), timeout=120,
                      json={"question": QUESTION})


def _assert_answers(service) -> None:
    answered = _ask(service)
    assert answered.status_code == 200 and answered.json()["citations"], answered.text
    chat = service.client().chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTION}])
    assert chat.choices[0].message.content
    ready = httpx.get(f"{service.url}/readyz", timeout=30)
    assert ready.status_code == 200 and ready.json()["database"] == "ok", ready.text


def test_service_answers_503_while_the_database_is_away_and_recovers_without_a_restart(pg_service):
    service, server = pg_service
    dsn = server.dsn
    password = _password(dsn)
    _assert_answers(service)
    pid = service.process.pid

    with server_stopped(server, "immediate"):  # a crash: no goodbye to the service's connections
        port = server.status()["port"]
        for _ in range(2):  # the second finds no connection at all (the first dropped the dead one)
            down = _ask(service)
            assert down.status_code == 503, down.text
            assert down.headers["Retry-After"].isdigit() and int(down.headers["Retry-After"]) > 0
            error = down.json()["error"]
            assert error["type"] == "service_unavailable" and "database" in error["message"], error
            assert password not in down.text and "127.0.0.1" not in down.text  # the address is for the log
        with pytest.raises(openai.InternalServerError) as err:
            service.client().chat.completions.create(model="default",
                                                     messages=[{"role": "user", "content": QUESTION}])
        assert err.value.status_code == 503 and err.value.response.headers.get("Retry-After")
        assert err.value.body["type"] == "service_unavailable" and password not in str(err.value.body)
        with pytest.raises(openai.InternalServerError) as err:  # streamed: refused before the stream starts
            service.client().chat.completions.create(model="default", stream=True,
                                                     messages=[{"role": "user", "content": QUESTION}])
        assert err.value.status_code == 503
        ready = httpx.get(f"{service.url}/readyz", timeout=30)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["ready"] is False and body["database"] == "not answering"
        # No key on /readyz: it says why, but not where (host and port go to the log).
        assert "database" in body["detail"] and f"127.0.0.1:{port}" not in ready.text, body
        assert str(port) not in ready.text and password not in ready.text
        assert f"127.0.0.1:{port}" in service.log.read_text(), "the log names the server"
        assert httpx.get(f"{service.url}/healthz", timeout=10).status_code == 200  # the process is fine

    # Back: the very next request succeeds, in the same process.
    _assert_answers(service)
    # Down and up again with no request in between: the service's idle connection is dead; the
    # first request after the restart must not fail on it.
    with server_stopped(server, "fast"):
        pass
    _assert_answers(service)
    assert service.process.pid == pid and service.process.poll() is None
    log = service.log.read_text()
    assert "document store unavailable" in log and "127.0.0.1" in log  # what failed, for the operator
    assert password not in log
