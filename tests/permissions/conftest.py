"""The identity contract: every test that takes `ids` runs on each backend of permissions.identity.Identity.

- sqlite: the data directory's catalog (the embedded default);
- postgres: rag.pg_identity.PgIdentityStore over a fresh database of a real throwaway server
  (store = pgvector: what every replica shares).

`raw` reads and edits the stored rows behind the backend's back, as an operator or an attacker
with the database file could: the stored hashes, and a user removed by hand.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pytest

from permissions.identity import Identity, IdentityStore

BACKENDS = ["sqlite", "postgres"]


class RawRows:
    """The stored rows of one backend, read and edited directly."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        if self.kind == "sqlite":
            with sqlite3.connect(self.where) as conn:
                return conn.execute(sql.replace("%s", "?").replace("rag_api_keys", "api_keys")
                                    .replace("rag_users", "users"), params).fetchall()
        import psycopg

        with psycopg.connect(self.where, autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def key_rows(self) -> list[tuple]:
        return self._query("SELECT * FROM rag_api_keys")

    def hashes(self) -> dict[str, str]:
        return dict(self._query("SELECT key_id, key_hash FROM rag_api_keys"))

    def delete_user(self, name: str) -> None:
        self._query("DELETE FROM rag_users WHERE name = %s", (name,))


@pytest.fixture(params=BACKENDS)
def identity_backend(request, tmp_path) -> Iterator[tuple[Identity, RawRows]]:
    if request.param == "sqlite":
        path = tmp_path / "c.sqlite"
        store = IdentityStore(path)
        yield store, RawRows("sqlite", str(path))
        store.close()
        return
    pytest.importorskip("psycopg")
    from rag.pg_identity import PgIdentityStore
    from tests.pg_fixture import fresh_database

    with fresh_database(request.getfixturevalue("pg_server")) as dsn:
        store = PgIdentityStore(dsn)
        yield store, RawRows("postgres", dsn)
        store.close()


@pytest.fixture
def ids(identity_backend) -> Identity:
    return identity_backend[0]


@pytest.fixture
def raw(identity_backend) -> RawRows:
    return identity_backend[1]
