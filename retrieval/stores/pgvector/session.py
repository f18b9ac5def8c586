"""One PostgreSQL connection of a pgvector collection: opened with the session settings its
searches need, retried once after the server dropped it, its errors told in words.

Used by one thread at a time (a lock): `PgvectorCollection` runs every statement through
`read` (autocommit) or `write` (one transaction). There is no pool: a connection found broken is
dropped at once, so the first call after the server comes back opens a fresh one (a server that
went away while the connection sat idle costs that call one reconnect, not a failure). A server
that does not answer, or a connection lost mid-statement, raises `StoreUnavailable` (the service
answers 503); every message shows the DSN without its password (`mask_dsn`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from rag.errors import StoreError, StoreUnavailable
from retrieval.stores.pgvector.schema import connect, mask_dsn

log = logging.getLogger(__name__)

T = TypeVar("T")


class PgSession:
    """A connection to `dsn`, opened on first use and reopened after a drop.

    Args:
        describe: the collection's name, for error messages (called when one is raised).
        ef_search, max_scan_tuples: the HNSW session settings of its searches.
        durable_commits: wait for each commit's WAL flush (see `PgvectorCollection`).
    """

    def __init__(self, dsn: str, describe: Callable[[], str], ef_search: int, max_scan_tuples: int,
                 durable_commits: bool) -> None:
        self.dsn = dsn
        self.ef_search = ef_search
        self.max_scan_tuples = max_scan_tuples
        self.durable_commits = durable_commits
        self._describe = describe
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def connection(self) -> psycopg.Connection:
        """The open connection, or a new one (StoreUnavailable when the server does not answer)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = None
            conn = connect(self.dsn, autocommit=True)
            try:
                from pgvector.psycopg import register_vector

                register_vector(conn)
                # Session-wide, so an approximate search is one statement and one round trip.
                # relaxed_order: the search query re-sorts its k rows anyway.
                conn.execute(sql.SQL(
                    "SET hnsw.iterative_scan = relaxed_order; SET hnsw.ef_search = {};"
                    " SET hnsw.max_scan_tuples = {}"
                ).format(sql.Literal(self.ef_search), sql.Literal(self.max_scan_tuples)))
                if not self.durable_commits:
                    # One transaction per document would otherwise wait for a WAL flush each
                    # (~10 ms here). A server crash can lose the last moments of commits of new
                    # documents, whole ones only; the next ingest finds them missing from the
                    # stored states and writes them again. Writes that narrow or remove access
                    # (updates, ACL changes, deletions) still commit durably
                    # (`PgvectorCollection._durable`).
                    conn.execute("SET synchronous_commit = off")
            except psycopg.OperationalError as e:  # the server went away between connect and SET
                conn.close()
                raise StoreUnavailable(
                    f"lost the connection to PostgreSQL at {mask_dsn(self.dsn)} while opening it ({_first_line(e)}): "
                    f"{WHAT_TO_DO}") from e
            except psycopg.Error as e:
                conn.close()
                raise StoreError(
                    f"{mask_dsn(self.dsn)} has no usable pgvector ({e}): run `rag db migrate` or "
                    "`CREATE EXTENSION vector` there"
                ) from e
            # Plans depend on how selective a principal's tokens are: plan every query afresh.
            conn.prepare_threshold = None
            self._conn = conn
        return self._conn

    def write(self, what: str, fn: Callable[[psycopg.Connection], object]) -> None:
        """Run `fn` in one transaction.

        A connection found dead at BEGIN (dropped while idle) is replaced and the write runs
        once more. One lost later raises, and the next call reconnects: the transaction rolled
        back, or committed if the drop came after COMMIT; every write is idempotent, so running
        it again is safe either way.
        """
        with self._lock:
            for attempt in range(2):
                conn = self.connection()
                began = False
                try:
                    with conn.transaction():
                        began = True
                        fn(conn)
                    return
                except psycopg.Error as e:
                    error = self._error(what, conn, e)
                    if began or self._conn is not None or attempt == 1:
                        raise error from e
                    log.warning("lost the connection to %s; reconnecting", mask_dsn(self.dsn))

    def read(self, what: str, fn: Callable[[psycopg.Connection], T]) -> T:
        """Run `fn` (autocommit statements); after a dropped connection, reconnect and retry once."""
        with self._lock:
            for attempt in range(2):
                conn = self.connection()
                try:
                    return fn(conn)
                except psycopg.Error as e:
                    error = self._error(what, conn, e)
                    if self._conn is not None or attempt == 1:
                        raise error from e
                    log.warning("lost the connection to %s; reconnecting", mask_dsn(self.dsn))
        raise AssertionError("unreachable")

    def _error(self, what: str, conn: psycopg.Connection, e: psycopg.Error) -> StoreError:
        if not (conn.closed or conn.broken):
            return StoreError(f"{what} in collection {self._describe()!r} failed: {e}")
        self._conn = None  # the next call reconnects
        return StoreUnavailable(
            f"lost the connection to PostgreSQL at {mask_dsn(self.dsn)} while {what} "
            f"({_first_line(e)}): {WHAT_TO_DO}"
        )


# What every "server gone" message ends with: what to do, and that nothing was half-written.
WHAT_TO_DO = ("nothing was half-written (each document is one transaction); check that the server is "
              "running (`rag db status` for a local one) and run the same command again: an ingest "
              "resumes where it stopped")


def ping(dsn: str, timeout: float = 3.0) -> str | None:
    """None when the server at `dsn` answers a query within `timeout` seconds, else why not (no password).

    A connection of its own, not a collection's: a readiness probe must not wait behind a search.
    """
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=max(1, round(timeout))) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as e:
        return f"PostgreSQL at {server_address(dsn)} does not answer ({mask_dsn(_first_line(e))})"
    return None


def server_address(dsn: str) -> str:
    """host:port/database of a DSN (URL or key=value), without user or password."""
    try:
        info = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "the configured server"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}".rstrip("/")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
