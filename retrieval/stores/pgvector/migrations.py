"""A versioned, lock-guarded migration runner for a set of tables in PostgreSQL.

The chunk store's schema (`schema.MIGRATIONS`) and the shared identity tables
(`rag.pg_identity_schema`) each keep their own version table and advisory lock, so either can
be migrated without the other, by many processes at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

from rag.errors import StoreError


@dataclass(frozen=True)
class MigrationSet:
    """What one runner migrates: its steps, the table recording them, its lock and its name in errors."""

    migrations: Sequence[tuple[int, str]]  # (version, DDL), ascending
    version_table: str
    lock: int  # pg_advisory_lock key, unique to this set
    what: str  # "the rag schema", "the rag identity tables"

    @property
    def latest(self) -> int:
        return self.migrations[-1][0]


def migrate(
    conn: psycopg.Connection,
    steps: MigrationSet,
    where: str,
    before: Callable[[psycopg.Connection], None] | None = None,
) -> int:
    """Bring `steps` to their latest version over `conn` (autocommit) and return the version now.

    `where` names the server in errors (a masked DSN). `before` runs under the lock before any
    step (e.g. creating an extension). Each step commits with its version row, so a run cut short
    resumes where it stopped.

    Raises:
        StoreError: a step failed, or a newer version of this project migrated the tables.
    """
    version = current_version(conn, steps)
    if version >= steps.latest:
        _check_not_newer(version, steps, where)
        return version
    conn.execute("SELECT pg_advisory_lock(%s)", (steps.lock,))
    try:
        if before is not None:
            before(conn)
        with conn.transaction():
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {steps.version_table} ("
                " version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
        # Read again under the lock: another process may have migrated while we waited.
        version = current_version(conn, steps)
        _check_not_newer(version, steps, where)
        for number, ddl in steps.migrations:
            if number <= version:
                continue
            with conn.transaction():
                conn.execute(ddl)
                conn.execute(f"INSERT INTO {steps.version_table} (version) VALUES (%s)", (number,))
            version = number
    except psycopg.Error as e:
        raise StoreError(f"migrating {steps.what} in {where} failed: {e}") from e
    finally:
        # Closing the session releases the lock anyway; unlocking is a courtesy.
        with contextlib.suppress(psycopg.Error):
            conn.execute("SELECT pg_advisory_unlock(%s)", (steps.lock,))
    return version


def current_version(conn: psycopg.Connection, steps: MigrationSet) -> int:
    """The highest version recorded in the set's table (0 when the table does not exist)."""
    if conn.execute("SELECT to_regclass(%s)", (steps.version_table,)).fetchone()[0] is None:
        return 0
    return int(conn.execute(f"SELECT coalesce(max(version), 0) FROM {steps.version_table}").fetchone()[0])


def _check_not_newer(version: int, steps: MigrationSet, where: str) -> None:
    if version > steps.latest:
        raise StoreError(
            f"{steps.what} in {where} {'are' if steps.what.endswith('s') else 'is'} at version {version}, "
            f"newer than this install knows ({steps.latest}): upgrade rag on this machine"
        )
