"""Two `rag serve` replicas over one PostgreSQL (store = pgvector): one set of keys, one directory, one audit log.

Real processes throughout: the servers are `rag serve` subprocesses with their own data
directories, and the operator's commands are `rag keys` / `rag users` / `rag audit` subprocesses
reading the same settings (RAG_STORE, RAG_DSN).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.rag.conftest import DEMO_USERS, REPO
from tests.rag.serve_fixture import running_service

pytestmark = pytest.mark.slow  # two servers with real models, an ingest

GENOMICS_Q = "What temperature is the -80 freezer alarm set to?"
FREEZER = "genomics/freezer-inventory"  # readable by group:genomics only (its .rag-acl.toml)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, rag_factory, lab_copy, model_cache, pg_server):
    """(replica A, replica B, the operator's env): two servers over one freshly ingested database."""
    from tests.pg_fixture import fresh_database

    with fresh_database(pg_server) as dsn:
        admin_home = tmp_path_factory.mktemp("operator-home")
        rag = rag_factory(admin_home, store="pgvector", dsn=dsn, rerank=False)
        try:
            assert rag.ingest([lab_copy]).ok
            for user, groups in DEMO_USERS.items():
                rag.identity.add_user(user, groups)
        finally:
            rag.close()
        env = {"RAG_STORE": "pgvector", "RAG_DSN": dsn, "RAG_RERANK": "false", "RAG_ANSWER_MODE": "extract"}
        homes = []
        for name in ("replica-a", "replica-b"):  # each replica has a data directory of its own
            home = tmp_path_factory.mktemp(name)
            (home / "models").symlink_to(model_cache, target_is_directory=True)
            homes.append(home)
        with running_service(homes[0], {}, env) as a, running_service(homes[1], {}, env) as b:
            yield a, b, {**env, "RAG_HOME": str(admin_home)}


def _rag(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "rag.cli", *args], env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _ask(service, key: str, question: str = "Which GPU nodes can I use?") -> httpx.Response:
    return httpx.post(f"{service.url}/v1/query", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"question": question, "generate": False, "k": 5})


def _sources(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["source"] for c in r.json()["citations"]]


def test_a_cli_key_works_on_both_and_a_revocation_reaches_the_other_on_its_next_request(cluster):
    a, b, operator = cluster
    key = _rag(operator, "keys", "create", "--user", "bob", "--label", "two replicas").strip()
    for _ in range(3):  # both replicas have the key in their caches now
        assert _ask(a, key).status_code == 200 and _ask(b, key).status_code == 200
    assert _ask(b, key).json()["user"] == "bob"
    _rag(operator, "keys", "revoke", key.split("_")[1])
    refused = _ask(b, key)
    assert refused.status_code == 401 and "citations" not in refused.text
    assert _ask(a, key).status_code == 401


def test_a_user_added_to_a_group_sees_its_documents_on_the_other_replica_next_request(cluster):
    a, b, operator = cluster
    key = _rag(operator, "keys", "create", "--user", "dave").strip()  # dave: registered with no groups
    assert not any(FREEZER in s for s in _sources(_ask(b, key, GENOMICS_Q)))
    _rag(operator, "users", "add", "dave", "-g", "genomics")
    assert any(FREEZER in s for s in _sources(_ask(b, key, GENOMICS_Q)))
    assert any(FREEZER in s for s in _sources(_ask(a, key, GENOMICS_Q)))
    _rag(operator, "users", "add", "dave")  # and out again
    assert not any(FREEZER in s for s in _sources(_ask(a, key, GENOMICS_Q)))


def test_both_replicas_write_one_audit_log(cluster):
    a, b, operator = cluster
    key = _rag(operator, "keys", "create", "--user", "alice", "--label", "audit").strip()
    key_id = key.split("_")[1]
    statuses = [_ask(a, key).status_code, _ask(b, key).status_code, _ask(a, key).status_code]
    bad = _ask(b, key[:-1] + ("A" if key[-1] != "A" else "B"))  # a wrong secret: refused, audited without a user
    assert statuses == [200, 200, 200] and bad.status_code == 401
    entries = [json.loads(line) for line in _rag(operator, "audit", "--user", "alice", "--json").splitlines()]
    mine = [e for e in entries if e["key_id"] == key_id]
    assert [e["status"] for e in mine] == [200, 200, 200] and all(e["route"] == "/v1/query" for e in mine)
    everyone = [json.loads(line) for line in _rag(operator, "audit", "--json").splitlines()]
    assert any(e["status"] == 401 and e["user"] is None for e in everyone)
    # Nothing in either replica's data directory: the log is the database's.
    for service in (a, b):
        assert not (Path(service.home) / "audit.jsonl").exists()
