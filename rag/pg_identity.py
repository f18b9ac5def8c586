"""Users, groups and API keys in PostgreSQL (store = pgvector): one directory for every replica.

The rules are permissions.identity.KeyDirectory's, unchanged (hash-only keys, one constant-time
comparison, scopes, proxy and admin keys); this module stores their rows.

The cache: each process keeps the key rows and users it has read, valid for one value of
`rag_identity_version`, which a trigger bumps with every change of users or keys (any replica,
the CLI, a hand edit). Each authentication starts with one indexed read of that single row; a
new value empties the cache. So a request costs one tiny query instead of three (key, user,
admin flag), and a revocation or a change of groups is seen by every replica on the first
request that starts after it committed: there is no TTL to wait out. Reads in the same request
(the admin flag, a proxy key's user) use the cache the authentication just checked; reads in a
thread that has not authenticated within CHECKED_FOR seconds go to the database.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import psycopg

from permissions.identity import KeyDirectory, KeyInfo, KeyRecord, KeyRow
from permissions.models import Principal
from rag.errors import StoreError, StoreUnavailable
from rag.pg_identity_schema import migrate_identity
from retrieval.stores.pgvector.schema import connect, mask_dsn

T = TypeVar("T")

CHECKED_FOR = 1.0  # seconds a thread's version check covers its later reads (one request's)
MAX_CACHED = 50_000  # rows of each kind; past it the cache starts again (unknown ids are cached too)


class _VersionedCache:
    """Key rows and users read at one identity version; emptied when a newer version is seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version: int | None = None
        self.keys: dict[str, KeyRow | None] = {}
        self.users: dict[str, list[str] | None] = {}

    def saw(self, version: int) -> None:
        with self.lock:
            if self.version is None or version > self.version:
                self.version = version
                self.keys.clear()
                self.users.clear()

    def store(self, table: dict, version: int, name: str, value: object) -> None:
        with self.lock:
            # Only under the version it was read at: a row read before a change that another
            # thread has already seen must not outlive that change.
            if self.version == version:
                if len(table) >= MAX_CACHED:
                    table.clear()
                table[name] = value


class PgIdentityStore(KeyDirectory):
    """The identity directory in the PostgreSQL database at `dsn` (migrated on first use).

    Args:
        dsn: the database URL, or a function that returns it (resolved on first use).
        cache: keep rows between requests, checked by the identity version (False: every read
            goes to the database; for measurements).
    """

    _db_errors = (psycopg.Error, StoreError)

    def __init__(self, dsn: str | Callable[[], str], cache: bool = True) -> None:
        self._dsn_source = dsn
        self._dsn: str | None = dsn if isinstance(dsn, str) else None
        self._cache = _VersionedCache() if cache else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[psycopg.Connection] = []
        self._migrated = False
        self._closed = False

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            self._dsn = self._dsn_source()  # type: ignore[operator]
        return self._dsn

    # -- connections (one per thread: the API authenticates from many threads at once) ---

    def _connection(self) -> psycopg.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            if self._closed:
                raise StoreError("the identity store was closed")
            if not self._migrated:
                migrate_identity(self.dsn)
                self._migrated = True
        conn = connect(self.dsn, autocommit=True)
        self._local.conn = conn
        with self._lock:
            self._conns.append(conn)
        return conn

    def _run(self, what: str, fn: Callable[[psycopg.Connection], T]) -> T:
        """`fn` on this thread's connection; a connection found dropped is replaced once."""
        for attempt in range(2):
            conn = self._connection()
            try:
                return fn(conn)
            except psycopg.Error as e:
                if conn.closed or conn.broken:
                    self._local.conn = None
                    if attempt == 0:
                        continue  # dropped while idle (a server restart): once more on a new connection
                    raise StoreUnavailable(f"lost the connection to PostgreSQL at {mask_dsn(self.dsn)} while "
                                           f"{what} ({e}): check the server") from e
                raise StoreError(f"{what} in {mask_dsn(self.dsn)} failed: {e}") from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    # -- the cache ----------------------------------------------------------------------

    def identity_version(self) -> int:
        """The identity version now in the database (bumped by every change of users or keys)."""
        return self._run("reading the identity version", lambda c: int(
            c.execute("SELECT version FROM rag_identity_version").fetchone()[0]))

    def _begin_lookup(self) -> None:
        if self._cache is None:
            return
        version = self.identity_version()
        self._cache.saw(version)
        self._local.checked = (version, time.monotonic())

    def _changed(self) -> None:
        """After a write of this process: nothing read before it may answer a later read."""
        self._local.checked = None
        if self._cache is not None:
            with self._cache.lock:
                self._cache.keys.clear()
                self._cache.users.clear()

    def _checked_version(self) -> int | None:
        """The version this thread checked within CHECKED_FOR seconds, if the cache holds it."""
        if self._cache is None:
            return None
        checked = getattr(self._local, "checked", None)
        if checked is None or time.monotonic() - checked[1] > CHECKED_FOR or checked[0] != self._cache.version:
            return None
        return checked[0]

    def _cached(self, table_of: Callable[[_VersionedCache], dict], name: str, read: Callable[[], T]) -> T:
        version = self._checked_version()
        if version is None:
            return read()
        table = table_of(self._cache)
        hit = table.get(name, _MISSING)
        if hit is not _MISSING:
            return hit  # type: ignore[return-value]
        value = read()
        self._cache.store(table, version, name, value)
        return value

    # -- storage primitives ----------------------------------------------------------------

    def _put_user(self, name: str, groups: list[str]) -> None:
        self._run("registering a user", lambda c: c.execute(
            "INSERT INTO rag_users (name, groups, created_at) VALUES (%s, %s, %s)"
            " ON CONFLICT (name) DO UPDATE SET groups = excluded.groups", (name, groups, time.time())))
        self._changed()

    def _user_rows(self) -> list[tuple[str, list[str]]]:
        return self._run("listing users", lambda c: [
            (r[0], list(r[1])) for r in c.execute("SELECT name, groups FROM rag_users ORDER BY name")])

    def _user_groups(self, name: str) -> list[str] | None:
        def read() -> list[str] | None:
            row = self._run("looking a user up", lambda c: c.execute(
                "SELECT groups FROM rag_users WHERE name = %s", (name,)).fetchone())
            return None if row is None else list(row[0])

        return self._cached(lambda cache: cache.users, name, read)

    def _insert_key(self, record: KeyRecord) -> None:
        self._run("storing a key", lambda c: c.execute(*_insert_key_statement(record)))
        self._changed()

    def _key_row(self, key_id: str) -> KeyRow | None:
        def read() -> KeyRow | None:
            row = self._run("looking a key up", lambda c: c.execute(
                "SELECT key_hash, user_name, revoked, kind, scope, admin FROM rag_api_keys WHERE key_id = %s",
                (key_id,)).fetchone())
            if row is None:
                return None
            return KeyRow(row[0], row[1], row[2], row[3], None if row[4] is None else tuple(row[4]), row[5])

        return self._cached(lambda cache: cache.keys, key_id, read)

    def _key_records(self) -> list[KeyRecord]:
        rows = self._run("listing keys", lambda c: c.execute(
            "SELECT key_id, user_name, groups, label, created_at, revoked, kind, scope, key_hash, admin"
            " FROM rag_api_keys ORDER BY created_at").fetchall())
        return [KeyRecord(KeyInfo(r[0], r[1], tuple(r[2]), r[3], r[4], r[5], r[6],
                                  None if r[7] is None else tuple(r[7])), r[8], r[9]) for r in rows]

    def _revoke(self, key_id: str) -> bool:
        revoked = self._run("revoking a key", lambda c: c.execute(
            "UPDATE rag_api_keys SET revoked = true WHERE key_id = %s", (key_id,)).rowcount > 0)
        self._changed()
        return revoked

    # -- moving a data directory's identity here --------------------------------------------

    def import_records(self, users: Iterable[Principal], keys: Iterable[KeyRecord]) -> ImportReport:
        """Add users and keys (hashes, revocations, scopes, admin flags) that are not here yet.

        One transaction; running it again adds nothing. A user already here keeps the groups
        stored here (listed in `conflicts` where they differ), and a key id already here is skipped.
        """
        users, keys = list(users), list(keys)

        def copy(conn: psycopg.Connection) -> ImportReport:
            report = ImportReport()
            with conn.transaction():
                for p in users:
                    row = conn.execute("SELECT groups FROM rag_users WHERE name = %s", (p.user,)).fetchone()
                    if row is None:
                        conn.execute("INSERT INTO rag_users (name, groups, created_at) VALUES (%s, %s, %s)",
                                     (p.user, sorted(p.groups), time.time()))
                        report.users_added += 1
                    elif set(row[0]) != set(p.groups):
                        report.conflicts.append(p.user)
                for record in keys:
                    statement, params = _insert_key_statement(record)
                    if conn.execute(statement + " ON CONFLICT (key_id) DO NOTHING", params).rowcount:
                        report.keys_added += 1
            return report

        report = self._run("importing users and keys", copy)
        self._changed()
        return report


class ImportReport:
    """What `import_records` added, and the users whose groups differed (kept as they were here)."""

    def __init__(self) -> None:
        self.users_added = 0
        self.keys_added = 0
        self.conflicts: list[str] = []


def _insert_key_statement(record: KeyRecord) -> tuple[str, tuple]:
    i = record.info
    return ("INSERT INTO rag_api_keys (key_id, key_hash, user_name, groups, label, created_at, revoked, kind,"
            " scope, admin) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (i.key_id, record.key_hash, i.user, list(i.groups), i.label, i.created_at, i.revoked, i.kind,
             None if i.scope is None else list(i.scope), record.admin))


_MISSING = object()
