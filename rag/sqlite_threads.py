"""One SQLite connection per thread over one database file (stdlib only: every package may import it).

A `sqlite3.Connection` must not be used by two threads at once: with `check_same_thread=False`
and no lock, concurrent queries from the API's worker threads corrupted each other's cursors
(the serve benchmark on a 16-core machine saw valid keys refused, collections not found and
"bad parameter or other API misuse"). Each thread gets its own connection instead; WAL mode lets
them read in parallel while one writes.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable


class ThreadConnections:
    """`get()` returns this thread's connection, opened on first use by `open_connection`.

    Args:
        open_connection: opens and configures a new connection (pragmas, schema checks).
    """

    def __init__(self, open_connection: Callable[[], sqlite3.Connection]) -> None:
        self._open = open_connection
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[sqlite3.Connection] = []
        self._closed = False

    def get(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            with self._lock:
                if self._closed:
                    raise sqlite3.ProgrammingError("the database was closed")
            conn = self._open()
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def release(self) -> None:
        """Close this thread's connection, if it opened one (a thread that ends: ingest's writer)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            return
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def close(self) -> None:
        """Close every thread's connection (call when no thread uses the database any more)."""
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
