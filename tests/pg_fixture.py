"""A real PostgreSQL + pgvector for tests: one throwaway server per session, a fresh database per test.

Tests that stop and start the server (database faults) get one of their own (`own_pg_server`,
`server_stopped`), so no other test loses its database meanwhile.

The server is `rag.local_postgres.server.LocalPostgres` (the code path of `rag db start`) in a temporary directory,
tuned for speed over durability; like that one it wants a password, which every DSN here carries.
Each test's database is cloned from a template that already has the `vector` extension, which
halves the cost of CREATE DATABASE + CREATE EXTENSION per test.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from rag.local_postgres.server import LocalPostgres

TEMPLATE = "rag_test_template"
# Nothing here has to survive a crash of the test session.
THROWAWAY_OPTIONS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A PostgreSQL server on a free port for the whole session, stopped and deleted at the end."""
    pg = LocalPostgres(tmp_path_factory.mktemp("postgres"), server_options=THROWAWAY_OPTIONS)
    pg.start()
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
            with psycopg.connect(with_dbname(pg.dsn, TEMPLATE), autocommit=True) as tconn:
                tconn.execute("CREATE EXTENSION vector")
            # No connections allowed: CREATE DATABASE ... TEMPLATE fails while anyone is connected to it.
            conn.execute(sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
                         .format(sql.Identifier(TEMPLATE)))
        yield pg
    finally:
        pg.destroy()  # pg_ctl -m immediate, then delete the cluster


@pytest.fixture
def own_pg_server(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this test's own, which it may stop and start; deleted afterwards.

    Its default database (`server.dsn`, with the password) has the `vector` extension.
    """
    pg = LocalPostgres(tmp_path / "own-postgres", server_options=THROWAWAY_OPTIONS)
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


def stop_server(server: LocalPostgres, mode: str = "fast") -> int:
    """Stop `server` with pg_ctl (`mode`: fast, immediate, smart); returns its port, for `start_server`."""
    port = server.status()["port"]
    assert server.stop(mode), "the server was not running"
    return int(port)


def start_server(server: LocalPostgres, port: int) -> None:
    """Start `server` again on `port`: its DSN (password included) is the same as before the stop."""
    server.start(port=port)


@contextlib.contextmanager
def server_stopped(server: LocalPostgres, mode: str = "fast") -> Iterator[None]:
    """`server` down for the `with` block (pg_ctl stop), up again on the same port afterwards."""
    port = stop_server(server, mode)
    try:
        yield
    finally:
        start_server(server, port)


@pytest.fixture
def pg_dsn(pg_server: LocalPostgres) -> Iterator[str]:
    """DSN of a new, empty database with the `vector` extension, dropped after the test."""
    with fresh_database(pg_server) as dsn:
        yield dsn


@contextlib.contextmanager
def fresh_database(server: LocalPostgres) -> Iterator[str]:
    """A new database with the `vector` extension on `server` (for tests that need more than one)."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(TEMPLATE)))
    try:
        yield with_dbname(server.dsn, name)
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            # FORCE: a test may leave connections (or a pool) open.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def with_dbname(dsn: str, dbname: str) -> str:
    """The same server URL, password included, with another database (a URL, like `rag db start` prints)."""
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{dbname}"))
