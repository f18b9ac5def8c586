"""The audit log in PostgreSQL (store = pgvector): one append-only table for every replica.

Each row holds the same JSON line the embedded default appends to HOME/audit.jsonl
(rag/audit.py), with its time and user beside it for `rag audit --since/--user`. Rows are only
ever inserted: a trigger refuses UPDATE, DELETE and TRUNCATE (rag/pg_identity_schema.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from rag.audit import one_line_json
from rag.errors import StoreError, StoreUnavailable
from rag.pg_identity_schema import migrate_identity
from retrieval.stores.pgvector.schema import connect, mask_dsn


class PgAuditLog:
    """Appends entries to `rag_audit` and reads them back (the interface of rag.audit.AuditLog).

    `write` blocks on a round trip to the server: rag.audit calls it from a worker thread.
    """

    blocking = True

    def __init__(self, dsn: str | Callable[[], str], keep_questions: bool = False) -> None:
        self._dsn_source = dsn
        self.keep_questions = keep_questions
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None

    @property
    def dsn(self) -> str:
        return self._dsn_source if isinstance(self._dsn_source, str) else self._dsn_source()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            migrate_identity(self.dsn)
            self._conn = connect(self.dsn, autocommit=True)
        return self._conn

    def write(self, entry: dict[str, Any]) -> None:
        # As in the file: characters that strict UTF-8 cannot carry (a lone surrogate a client
        # sent) stay escaped rather than fail the write.
        line = one_line_json(entry).encode("utf-8", "backslashreplace").decode("utf-8")
        at = _entry_time(entry)
        user = entry.get("user") if isinstance(entry.get("user"), str) else None
        with self._lock:
            for attempt in range(2):
                conn = self._connection()
                try:
                    conn.execute("INSERT INTO rag_audit (at, user_name, entry) VALUES (%s, %s, %s)",
                                 (at, user, line))
                    return
                except psycopg.Error as e:
                    if conn.closed or conn.broken:
                        if attempt == 0:
                            continue  # dropped while idle: once more on a new connection
                        raise StoreUnavailable(f"lost the connection to PostgreSQL at {mask_dsn(self.dsn)} "
                                               f"while writing the audit log ({e})") from e
                    raise StoreError(f"writing the audit log in {mask_dsn(self.dsn)} failed: {e}") from e

    def read(self, user: str | None = None, since: datetime | None = None,
             limit: int | None = None) -> list[dict[str, Any]]:
        """Entries in the order written, filtered; with `limit`, the last `limit` that match."""
        where, params = [], []
        if user is not None:
            where.append("user_name = %s")
            params.append(user)
        if since is not None:
            where.append("at >= %s")
            params.append(since.astimezone(UTC))
        query = "SELECT entry FROM rag_audit" + (" WHERE " + " AND ".join(where) if where else "")
        if limit:
            query = f"SELECT entry FROM ({query.replace('SELECT entry', 'SELECT id, entry')}" \
                    f" ORDER BY id DESC LIMIT %s) AS last ORDER BY id"
            params.append(limit)
        else:
            query += " ORDER BY id"
        with self._lock:
            try:
                rows = self._connection().execute(query, params).fetchall()
            except psycopg.Error as e:
                raise StoreError(f"reading the audit log in {mask_dsn(self.dsn)} failed: {e}") from e
        return [json.loads(r[0]) for r in rows]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _entry_time(entry: dict[str, Any]) -> datetime:
    try:
        return datetime.fromisoformat(entry["time"])
    except (KeyError, TypeError, ValueError):
        return datetime.now(UTC)
