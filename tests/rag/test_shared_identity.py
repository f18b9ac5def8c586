"""Shared identity (store = pgvector): users, keys and the audit log in PostgreSQL, seen by every replica.

Two `PgIdentityStore`s over one database stand for two replicas' processes: what one changes (or
an operator edits by hand) the other sees on its next authentication, while an unchanged
directory costs one tiny query per request. The audit table is one append-only log; `rag users
migrate` moves a data directory's users and keys there; `rag keys`/`rag users`/`rag audit`
follow the store setting.
"""

from __future__ import annotations

import hashlib
import threading
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from typer.testing import CliRunner

from permissions.identity import Identity, IdentityStore
from permissions.models import Principal
from rag.errors import AuthenticationError, StoreError
from rag.pg_audit import PgAuditLog
from rag.pg_identity import PgIdentityStore
from rag.pg_identity_schema import LATEST, migrate_identity


def _queries(store: PgIdentityStore, monkeypatch) -> list[str]:
    """The statements `store` runs from now on (each one round trip), by what they were for."""
    seen: list[str] = []
    real = store._run

    def counted(what, fn):
        seen.append(what)
        return real(what, fn)

    monkeypatch.setattr(store, "_run", counted)
    return seen


def test_both_backends_are_the_identity_protocol(pg_dsn, tmp_path):
    sqlite, pg = IdentityStore(tmp_path / "c.sqlite"), PgIdentityStore(pg_dsn)
    assert isinstance(sqlite, Identity) and isinstance(pg, Identity)
    sqlite.close()
    pg.close()


def test_a_key_made_on_one_replica_works_on_the_other(replicas):
    a, b = replicas
    key = a.create_key("alice", ["genomics"])
    assert b.authenticate(key) == Principal("alice", frozenset({"genomics"}))


def test_a_revocation_is_refused_on_the_other_replicas_next_request(replicas):
    a, b = replicas
    key = a.create_key("alice", ["genomics"])
    for _ in range(3):  # b's cache now holds the key
        assert b.authenticate(key).user == "alice"
    a.revoke_key(key.split("_")[1])
    with pytest.raises(AuthenticationError):
        b.authenticate(key)


def test_a_change_of_groups_applies_on_the_other_replicas_next_request(replicas):
    a, b = replicas
    key = a.create_key("bob", ["imaging"])
    proxy = a.create_key(None, label="open-webui", proxy=True)
    assert b.authenticate(key).groups == {"imaging"}
    assert b.authenticate_key(proxy).is_proxy and b.registered("bob").groups == {"imaging"}
    a.add_user("bob", ["imaging", "genomics"])
    assert b.authenticate(key).groups == {"imaging", "genomics"}
    b.authenticate_key(proxy)  # a proxy request: its user is read after the key, in the same request
    assert b.registered("bob").groups == {"imaging", "genomics"}
    a.add_user("newcomer", ["hpc"])  # a new user, through a front end's key, on their first request
    b.authenticate_key(proxy)
    assert b.registered("newcomer") == Principal("newcomer", frozenset({"hpc"}))


def test_a_hand_edit_of_the_tables_is_seen_too(replicas, pg_dsn):
    a, b = replicas
    key = a.create_key("alice", ["genomics"])
    assert b.authenticate(key).groups == {"genomics"}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # an operator in psql
        conn.execute("UPDATE rag_api_keys SET revoked = true")
    with pytest.raises(AuthenticationError):
        b.authenticate(key)


def test_an_unchanged_directory_costs_one_query_per_request(replicas, monkeypatch):
    a, b = replicas
    key = a.create_key("carol", ["hpc-admins"], admin=True)
    proxy = a.create_key(None, label="librechat", proxy=True)
    seen = _queries(b, monkeypatch)

    def request(k):  # what rag/api/deps.py reads per request
        auth = b.authenticate_key(k)
        return auth, b.is_admin(auth.key_id) if not auth.is_proxy else b.registered("carol")

    request(key)
    request(proxy)
    first = list(seen)
    assert first.count("reading the identity version") == 2 and len(first) > 2  # rows read once
    seen.clear()
    for _ in range(5):
        auth, admin = request(key)
        assert auth.principal.groups == {"hpc-admins"} and admin is True
        assert request(proxy)[1].groups == {"hpc-admins"}
    assert seen == ["reading the identity version"] * 10
    a.revoke_key(key.split("_")[1])
    seen.clear()
    with pytest.raises(AuthenticationError):
        request(key)
    assert seen == ["reading the identity version", "looking a key up"]  # the new version emptied the cache


def test_without_the_cache_every_read_is_a_query(pg_dsn, monkeypatch):
    store = PgIdentityStore(pg_dsn, cache=False)
    key = store.create_key("alice", ["genomics"])
    seen = _queries(store, monkeypatch)
    store.authenticate_key(key)
    store.authenticate_key(key)
    assert seen == ["looking a key up", "looking a user up"] * 2
    store.close()


def test_unknown_keys_are_refused_with_one_message_cached_or_not(replicas):
    a, b = replicas
    key = a.create_key("alice")
    unknown = "rag_0123456789ab_" + key.split("_", 2)[2]
    for _ in range(2):
        with pytest.raises(AuthenticationError, match="invalid or missing API key"):
            b.authenticate(unknown)
    wrong = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert b.authenticate(key).user == "alice"  # cached now: a wrong secret for a cached id is still refused
    with pytest.raises(AuthenticationError, match="invalid or missing API key"):
        b.authenticate(wrong)


def test_concurrent_authentications_and_a_revocation(replicas):
    a, b = replicas
    keys = [a.create_key(f"user{i}", ["g"]) for i in range(4)]
    errors: list[BaseException] = []

    def hammer(key):
        try:
            for _ in range(30):
                assert b.authenticate(key).groups == {"g"}
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    a.revoke_key(keys[0].split("_")[1])
    results = []

    def after(key):
        try:
            b.authenticate(key)
            results.append("ok")
        except AuthenticationError:
            results.append("refused")

    threads = [threading.Thread(target=after, args=(keys[0],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["refused"] * 4


def test_migrations_run_once_with_many_processes_at_once(pg_dsn):
    versions: list[int] = []
    threads = [threading.Thread(target=lambda: versions.append(migrate_identity(pg_dsn))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert versions == [LATEST] * 6
    with psycopg.connect(pg_dsn) as conn:
        applied = [r[0] for r in conn.execute("SELECT version FROM rag_identity_schema_version ORDER BY version")]
        assert applied == list(range(1, LATEST + 1))
        assert conn.execute("SELECT count(*) FROM rag_identity_version").fetchone()[0] == 1
    assert migrate_identity(pg_dsn) == LATEST  # again: nothing to do


def test_a_newer_identity_schema_is_refused(pg_dsn):
    migrate_identity(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO rag_identity_schema_version (version) VALUES (%s)", (LATEST + 1,))
    with pytest.raises(StoreError, match="upgrade rag"):
        migrate_identity(pg_dsn)


def test_only_hashes_reach_the_database(pg_dsn):
    store = PgIdentityStore(pg_dsn)
    key = store.create_key("alice", ["genomics"])
    with psycopg.connect(pg_dsn) as conn:
        dump = repr(conn.execute("SELECT * FROM rag_api_keys").fetchall())
        with pytest.raises(psycopg.errors.CheckViolation):  # a key pasted into the hash column
            conn.execute("INSERT INTO rag_api_keys (key_id, key_hash, user_name, groups, created_at)"
                         " VALUES ('x', %s, 'eve', '{}', 0)", (key,))
    assert key.split("_", 2)[2] not in dump and hashlib.sha256(key.encode()).hexdigest() in dump
    store.close()


# -- the audit log --------------------------------------------------------------------------


def test_the_audit_table_is_one_append_only_log(pg_dsn):
    first, second = PgAuditLog(pg_dsn), PgAuditLog(pg_dsn)  # two replicas
    now = datetime.now(UTC)
    old = (now - timedelta(days=2)).isoformat(timespec="milliseconds")
    first.write({"time": old, "user": "bob", "status": 200, "collection": "x\u2028{\"user\":\"alice\"}"})
    second.write({"time": now.isoformat(timespec="milliseconds"), "user": "alice", "status": 403,
                  "collection": "bad\udcff"})
    first.write({"time": now.isoformat(timespec="milliseconds"), "user": None, "status": 401})
    everything = second.read()
    assert [e["status"] for e in everything] == [200, 403, 401]
    assert everything[0]["collection"] == "x\u2028{\"user\":\"alice\"}"  # one entry, not a forged second
    assert list(everything[0]) == ["time", "user", "status", "collection"]  # as written, in order
    assert everything[1]["collection"] == "bad\udcff"  # written escaped, as in the file; read back the same
    assert [e["user"] for e in first.read(user="bob")] == ["bob"]
    assert [e["status"] for e in first.read(since=now - timedelta(hours=1))] == [403, 401]
    assert [e["status"] for e in first.read(limit=2)] == [403, 401]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in ("UPDATE rag_audit SET entry = '{}'", "DELETE FROM rag_audit", "TRUNCATE rag_audit"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                conn.execute(statement)
    assert len(second.read()) == 3
    first.close()
    second.close()


# -- the CLI ----------------------------------------------------------------------------------


def _cli(args: list[str], monkeypatch, **env: str):
    from rag.cli.main import app

    for name in ("RAG_STORE", "RAG_DSN", "RAG_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_keys_users_and_audit_commands_follow_the_store_setting(pg_dsn, tmp_path, monkeypatch):
    home = str(tmp_path / "admin-home")
    shared = {"RAG_STORE": "pgvector", "RAG_DSN": pg_dsn}
    _cli(["--home", home, "users", "add", "bob", "-g", "imaging"], monkeypatch, **shared)
    key = _cli(["--home", home, "keys", "create", "--user", "bob"], monkeypatch, **shared).strip()
    replica = PgIdentityStore(pg_dsn)
    assert replica.authenticate(key) == Principal("bob", frozenset({"imaging"}))
    assert "bob" in _cli(["--home", home, "keys", "list"], monkeypatch, **shared)
    assert "bob" not in _cli(["--home", home, "keys", "list"], monkeypatch)  # the embedded default: its own
    _cli(["--home", home, "keys", "revoke", key.split("_")[1]], monkeypatch, **shared)
    with pytest.raises(AuthenticationError):
        replica.authenticate(key)
    replica.close()
    PgAuditLog(pg_dsn).write({"time": datetime.now(UTC).isoformat(), "user": "bob", "status": 200})
    assert "bob" in _cli(["--home", home, "audit"], monkeypatch, **shared)
    assert _cli(["--home", home, "audit"], monkeypatch) == ""  # the data directory's file is empty


def test_users_migrate_moves_a_data_directorys_users_and_keys(pg_dsn, tmp_path, monkeypatch):
    home = tmp_path / "old-home"
    local = IdentityStore(home / "catalog.sqlite")
    alice = local.create_key("alice", ["genomics", "shared"])
    scoped = local.create_key("alice", scope=["shared"], label="notebook")
    admin = local.create_key("carol", ["hpc-admins"], admin=True)
    proxy = local.create_key(None, label="open-webui", proxy=True)
    revoked = local.create_key("dave", [])
    local.revoke_key(revoked.split("_")[1])
    local.close()
    PgIdentityStore(pg_dsn).add_user("carol", ["other"])  # already there with other groups: kept

    out = _cli(["--home", str(home), "users", "migrate", "--dsn", pg_dsn], monkeypatch)
    assert "copied 2 of 3 users and 5 of 5 keys" in out and "carol: registered there with other groups" in out
    shared = PgIdentityStore(pg_dsn)
    assert shared.authenticate(alice).groups == {"genomics", "shared"}
    assert shared.authenticate(scoped).groups == {"shared"}
    assert shared.authenticate(admin).groups == {"other"} and shared.is_admin(admin.split("_")[1])
    assert shared.authenticate_key(proxy).is_proxy
    with pytest.raises(AuthenticationError):
        shared.authenticate(revoked)
    assert "copied 0 of 3 users and 0 of 5 keys" in _cli(
        ["--home", str(home), "users", "migrate", "--dsn", pg_dsn], monkeypatch)
    shared.close()


def test_a_database_away_is_unavailable_and_the_next_request_after_it_reconnects(own_pg_server):
    from rag.errors import StoreUnavailable
    from tests.pg_fixture import server_stopped

    store, audit = PgIdentityStore(own_pg_server.dsn), PgAuditLog(own_pg_server.dsn)
    key = store.create_key("alice", ["genomics"])
    assert store.authenticate(key).user == "alice"
    audit.write({"time": datetime.now(UTC).isoformat(), "user": "alice", "status": 200})
    # "fast": the throwaway server commits asynchronously, so a crash (immediate) could lose the tables themselves
    with server_stopped(own_pg_server, "fast"):  # the idle connections are cut
        with pytest.raises(StoreUnavailable):  # 503 from the service, not a refusal of the key
            store.authenticate(key)
        with pytest.raises(StoreUnavailable):
            audit.write({"time": datetime.now(UTC).isoformat(), "user": "alice", "status": 503})
    assert store.authenticate(key).user == "alice"  # no restart of the process needed
    audit.write({"time": datetime.now(UTC).isoformat(), "user": "alice", "status": 200})
    assert [e["status"] for e in audit.read()] == [200, 200]
    store.close()
    audit.close()
