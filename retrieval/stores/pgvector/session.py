"""One PostgreSQL connection of a pgvector collection: opened with the session settings its
searches need, retried once after the server dropped it, its errors told in words.

Used by one thread at a time (a lock): `PgvectorCollection` runs every statement through
`read` (autocommit) or `write` (one transaction).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg import sql

from rag.errors import StoreError
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
        if self._conn is None or self._conn.closed:
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
        return StoreError(
            f"lost the connection to PostgreSQL at {mask_dsn(self.dsn)} while {what} ({e}); "
            "a document is never half-written: check the server and run again"
        )
