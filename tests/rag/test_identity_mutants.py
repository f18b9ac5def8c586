"""Shared identity (store = pgvector): what the cache, triggers, migration and audit log must not let through.

Each test pins one rule that the suite of tests/rag/test_shared_identity.py left unchecked: a read
outside a request is not answered from a cache past its time; a row read before a change never
outlives it in the cache; a hand edit of a user's groups reaches every replica; a rerun of
`rag users migrate` never revives a revoked key; proxy keys are never admins and a database that
cannot say is not an admin; the audit log names the user of the entry, refuses silently losing
entries, and the API audits a refused (revoked) key.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest

from permissions.identity import IdentityStore
from permissions.models import Principal
from rag import pg_identity
from rag.errors import AuthenticationError, StoreError
from rag.pg_audit import PgAuditLog
from rag.pg_identity import PgIdentityStore
from rag.pg_identity_schema import migrate_identity
from tests.rag.test_shared_identity import _queries


def _sql(dsn: str, statement: str, params: tuple = ()) -> None:
    """An operator's statement in psql."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement, params)


# -- the cache -----------------------------------------------------------------------------


def test_a_read_after_the_request_window_goes_to_the_database(replicas):
    """`registered`/`is_admin` in a thread that has not authenticated within CHECKED_FOR seconds
    must not answer from the cache (here: groups the user lost, an admin flag taken away)."""
    a, b = replicas
    key = a.create_key("bob", ["imaging"], admin=True)
    key_id = key.split("_")[1]
    assert b.authenticate(key).groups == {"imaging"} and b.is_admin(key_id)  # b's cache holds both
    a.add_user("bob", [])
    _sql(a.dsn, "UPDATE rag_api_keys SET admin = false")
    time.sleep(pg_identity.CHECKED_FOR + 0.3)
    assert b.registered("bob") == Principal("bob", frozenset())
    assert b.principal_for("bob").groups == frozenset()
    assert b.is_admin(key_id) is False


def test_a_write_is_seen_by_the_same_threads_next_read(pg_dsn):
    store = PgIdentityStore(pg_dsn)
    key = store.create_key("alice", ["genomics", "imaging"])
    assert store.authenticate(key).groups == {"genomics", "imaging"}
    store.add_user("alice", ["genomics"])  # within the same request window
    assert store.registered("alice").groups == {"genomics"}
    store.close()


def test_the_cache_works_again_after_a_change(replicas, monkeypatch):
    """After a change, requests again cost one query each (the cache follows the new version)."""
    a, b = replicas
    key = a.create_key("carol", ["hpc"])
    b.authenticate(key)
    a.add_user("carol", ["hpc", "gpu"])
    assert b.authenticate(key).groups == {"hpc", "gpu"}  # the change, seen
    seen = _queries(b, monkeypatch)
    for _ in range(3):
        assert b.authenticate(key).groups == {"hpc", "gpu"}
    assert seen == ["reading the identity version"] * 3


def test_a_row_read_before_a_revocation_is_not_cached_past_it(replicas, monkeypatch):
    """A key row read at version N, while another thread already saw N+1 (a revocation), must not
    be stored in the cache of N+1: the next request would accept the revoked key."""
    a, b = replicas
    key, other = a.create_key("alice", ["genomics"]), a.create_key("bob", ["imaging"])
    real = b._run
    raced: list[bool] = []

    def run(what, fn):
        result = real(what, fn)
        if what == "looking a key up" and not raced:
            raced.append(True)
            # Between this read of alice's (unrevoked) row and its storing: a revocation commits,
            # and another request thread sees the new version first.
            a.revoke_key(key.split("_")[1])
            t = threading.Thread(target=lambda: b.authenticate(other))
            t.start()
            t.join()
        return result

    monkeypatch.setattr(b, "_run", run)
    b.authenticate(key)  # in flight when the revocation committed: still answered
    assert raced
    with pytest.raises(AuthenticationError):
        b.authenticate(key)  # the next request: refused


# -- hand edits reach every replica --------------------------------------------------------


@pytest.mark.parametrize("edit", ["UPDATE rag_users SET groups = '{}' WHERE name = 'alice'",
                                  "DELETE FROM rag_users WHERE name = 'alice'"])
def test_a_hand_edit_of_a_users_groups_is_seen_on_the_next_request(replicas, pg_dsn, edit):
    a, b = replicas
    key = a.create_key("alice", ["genomics"])
    assert b.authenticate(key).groups == {"genomics"}
    _sql(pg_dsn, edit)  # alice loses genomics (or her directory entry: fail closed)
    assert b.authenticate(key).groups == frozenset()


# -- rag users migrate ---------------------------------------------------------------------


def test_migrating_again_never_revives_a_key_revoked_here(pg_dsn, tmp_path):
    local = IdentityStore(tmp_path / "catalog.sqlite")
    key = local.create_key("dave", ["x"])
    shared = PgIdentityStore(pg_dsn)
    assert shared.import_records(local.users(), local.key_records()).keys_added == 1
    shared.revoke_key(key.split("_")[1])  # revoked in the shared directory
    report = shared.import_records(local.users(), local.key_records())  # the old home still has it active
    assert report.keys_added == 0
    with pytest.raises(AuthenticationError):
        shared.authenticate(key)
    assert [k.revoked for k in shared.list_keys()] == [True]
    local.close()
    shared.close()


# -- admin keys ----------------------------------------------------------------------------


def test_a_proxy_key_flagged_admin_by_hand_is_not_an_admin(pg_dsn):
    store = PgIdentityStore(pg_dsn)
    proxy = store.create_key(None, label="open-webui", proxy=True)
    _sql(pg_dsn, "UPDATE rag_api_keys SET admin = true")  # every user of the front end would be one
    assert store.is_admin(proxy.split("_")[1]) is False
    assert store.admin_key_ids() == set()
    store.close()


def test_a_database_that_cannot_say_is_not_an_admin(pg_dsn):
    admin = PgIdentityStore(pg_dsn).create_key("carol", ["hpc"], admin=True)
    store = PgIdentityStore(pg_dsn)
    store.close()  # every read now fails with StoreError
    assert store.is_admin(admin.split("_")[1]) is False  # fail closed


# -- the audit log -------------------------------------------------------------------------


def test_an_entry_without_a_user_is_filed_under_no_user(pg_dsn):
    log = PgAuditLog(pg_dsn)
    now = datetime.now(UTC).isoformat()
    log.write({"time": now, "user": None, "key_id": "0123456789ab", "status": 403})
    log.write({"time": now, "user": "0123456789ab", "key_id": None, "status": 200})
    assert [e["status"] for e in log.read(user="0123456789ab")] == [200]
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT user_name FROM rag_audit ORDER BY id").fetchall() == [(None,), ("0123456789ab",)]
    log.close()


def test_an_audit_write_the_database_refuses_is_an_error_not_a_lost_entry(pg_dsn):
    migrate_identity(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # e.g. a replica pointed at a standby
        db = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
    log = PgAuditLog(pg_dsn)
    try:
        with pytest.raises(StoreError, match="writing the audit log"):
            log.write({"time": datetime.now(UTC).isoformat(), "user": "bob", "status": 200})
    finally:
        log.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = off")
            conn.execute(f'ALTER DATABASE "{db}" RESET default_transaction_read_only')


def test_the_api_refuses_and_audits_a_revoked_key(pg_dsn, tmp_path):
    from fastapi.testclient import TestClient

    from rag.api.app import create_app
    from rag.settings import load_settings

    settings = load_settings(home=tmp_path / "home", store="pgvector", dsn=pg_dsn, device="cpu")
    operator = PgIdentityStore(pg_dsn)
    key = operator.create_key("alice", ["genomics"])
    operator.revoke_key(key.split("_")[1])
    app = create_app(settings, preload=False)
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.post("/v1/query", json={"question": "anything?"}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401
    log = PgAuditLog(pg_dsn)
    entries = log.read()
    log.close()
    operator.close()
    assert [(e["status"], e["user"], e["route"]) for e in entries] == [(401, None, "/v1/query")]
