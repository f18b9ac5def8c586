"""The local PostgreSQL server (`rag db ...`) and the tests' fixture, against real servers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from rag.cli_db import db_app
from rag.db import LocalPostgres, local_dsn
from rag.errors import ConfigError, StoreError
from tests.pg_fixture import THROWAWAY_OPTIONS, fresh_database

DB = [sys.executable, "-c", "from rag.cli_db import db_app; db_app()"]
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    """A data directory that the server user can reach (pytest's tmp dirs are 0700 under root)."""
    home = Path(tempfile.mkdtemp(prefix="rag-db-test-", dir="/tmp"))  # not $TMPDIR, which may be private
    home.chmod(0o755)
    yield home
    LocalPostgres.for_home(home).destroy()
    shutil.rmtree(home, ignore_errors=True)


def _vector_version(dsn: str) -> tuple[int, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    assert row is not None, "vector extension missing"
    return tuple(int(p) for p in row[0].split("."))


def test_start_stop_restart_keeps_data(home):
    pg = LocalPostgres.for_home(home, server_options=THROWAWAY_OPTIONS)
    assert pg.status()["running"] is False and local_dsn(home) is None

    dsn = pg.start()
    info = pg.status()
    assert info["running"] and info["port"] > 0 and info["dsn"] == dsn == local_dsn(home)
    assert Path(info["data_dir"]) == home / "postgres" / "data"  # reachable: not relocated
    assert info["version"].startswith("18.")
    assert _vector_version(dsn) >= (0, 8)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE survives (v vector(3))")
        conn.execute("INSERT INTO survives VALUES ('[1,2,3]')")

    assert pg.start() == dsn and pg.status()["pid"] == info["pid"]  # idempotent: same server
    with pytest.raises(ConfigError, match="already runs on port"):
        pg.start(port=info["port"] + 1)

    assert pg.stop() is True
    stopped = pg.status()
    assert not stopped["running"] and stopped["dsn"] is None and local_dsn(home) is None
    assert pg.stop() is False

    assert pg.start() == dsn  # same cluster, same port
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT v::text FROM survives").fetchone() == ("[1,2,3]",)


def test_start_errors_name_the_cause(home):
    pg = LocalPostgres.for_home(home, server_options=THROWAWAY_OPTIONS)
    pg.stop()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=f"port {busy.getsockname()[1]} is already in use"):
            pg.start(port=busy.getsockname()[1])
    broken = LocalPostgres.for_home(home, server_options={"shared_buffers": "lots"})
    with pytest.raises(StoreError) as e:
        broken.start()
    message = str(e.value)
    assert "did not start" in message and "shared_buffers" in message
    assert str(pg.data_dir / "server.log") in message
    assert not pg.status()["running"]
    assert pg.start()  # the cluster is fine once the bad setting is gone


@pytest.mark.skipif(not IS_ROOT, reason="only root runs the server as another user")
def test_unreachable_home_relocates_the_cluster(tmp_path):
    home = tmp_path / "private"
    home.mkdir(mode=0o700)
    pg = LocalPostgres.for_home(home, server_options=THROWAWAY_OPTIONS)
    try:
        dsn = pg.start()
        data = Path(pg.status()["data_dir"])
        assert not data.is_relative_to(home) and (data / "PG_VERSION").exists()
        assert json.loads((home / "postgres" / "state.json").read_text())["data_dir"] == str(data)
        assert _vector_version(dsn) >= (0, 8)
    finally:
        pg.destroy()
    assert not data.exists()


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAG_HOME": str(home)}
    return subprocess.run(DB + args, env=env, capture_output=True, text=True, timeout=120)


def test_cli_start_status_stop(home, monkeypatch):
    # Real processes: the server must outlive the `rag db start` that launched it.
    started = _cli(["start"], home)
    assert started.returncode == 0, started.stderr
    dsn = started.stdout.strip()
    assert dsn.startswith("postgresql://") and "running on port" in started.stderr
    status = json.loads(_cli(["status", "--json"], home).stdout)
    assert status["running"] and status["dsn"] == dsn and status["data_dir"].startswith(str(home))
    assert _vector_version(dsn) >= (0, 8)

    monkeypatch.setenv("RAG_HOME", str(home))
    run = CliRunner().invoke
    assert run(db_app, ["status"]).output.startswith(f"PostgreSQL 18.6: running (pid {status['pid']})")
    assert run(db_app, ["stop"]).output == "stopped\n"
    assert run(db_app, ["status"]).output.startswith("PostgreSQL 18.6: stopped")
    assert run(db_app, ["stop"]).output == "not running\n"


def test_cli_migrate_without_a_database_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    result = CliRunner().invoke(db_app, ["migrate"])
    assert isinstance(result.exception, ConfigError)
    assert "rag db start" in str(result.exception) and "--dsn" in str(result.exception)


def test_cli_migrate(pg_dsn, tmp_path, monkeypatch):
    pytest.importorskip("retrieval.stores.pg_schema")
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    result = CliRunner().invoke(db_app, ["migrate", "--dsn", pg_dsn])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("schema version ")
    again = CliRunner().invoke(db_app, ["migrate", "--dsn", pg_dsn])
    assert again.exit_code == 0 and again.output == result.output


def test_fixture_databases_are_isolated_and_dropped(pg_server, pg_dsn):
    with fresh_database(pg_server) as other:
        assert other != pg_dsn
        assert _vector_version(pg_dsn) >= (0, 8) and _vector_version(other) >= (0, 8)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE mine (id int)")
        with psycopg.connect(other) as conn:
            assert conn.execute("SELECT to_regclass('mine')").fetchone() == (None,)
    other_name = other.rsplit("/", 1)[1]
    with psycopg.connect(pg_server.dsn) as conn:
        assert conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (other_name,)).fetchone() is None
