"""The local PostgreSQL server (`rag db ...`) and the tests' fixture, against real servers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from typer.testing import CliRunner

from rag.cli.db import db_app
from rag.errors import ConfigError, StoreError
from rag.local_postgres import processes as pg_runtime
from rag.local_postgres.server import LocalPostgres, local_dsn
from rag.private_files import exposed_paths
from tests.pg_fixture import THROWAWAY_OPTIONS, fresh_database, with_dbname

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    """A data directory that rag creates (owner-only) in a world-traversable directory (not pytest's 0700 ones)."""
    parent = Path(tempfile.mkdtemp(prefix="rag-db-test-", dir="/tmp"))  # not $TMPDIR, which may be private
    parent.chmod(0o755)
    home = parent / "home"
    yield home
    LocalPostgres.for_home(home).destroy()
    shutil.rmtree(parent, ignore_errors=True)


def _cluster_place(home: Path) -> Path:
    """Where the cluster of a home that rag made goes: the server user (root's) cannot enter a 0700 home."""
    return pg_runtime.relocated_dir((home / "postgres").resolve()) if IS_ROOT else home / "postgres" / "data"


def _not_owner_only(root: Path) -> list[str]:
    """Files and directories under `root` that give group or others any access (symlinks aside)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for path in [Path(dirpath)] + [Path(dirpath) / n for n in dirnames + filenames]:
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                bad.append(f"{path} {stat.filemode(st.st_mode)}")
    return bad


@pytest.fixture
def no_saved_passwords(monkeypatch):
    """libpq must not find a password anywhere but in the DSN (PGPASSWORD, ~/.pgpass)."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")


def _without_password(dsn: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))


def _refused(dsn: str, **kwargs: object) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=10, **kwargs).close()
    except psycopg.OperationalError as e:
        assert "password" in str(e), e  # refused for the password, not for some other reason
        return True
    return False


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
    assert Path(info["data_dir"]) == _cluster_place(home)
    # The home, our state and password, and the cluster with its log, socket and lock: owner-only.
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert _not_owner_only(home) == [] and _not_owner_only(Path(info["data_dir"])) == []
    assert {"server.log", "postmaster.pid", f".s.PGSQL.{info['port']}"} <= {
        p.name for p in Path(info["data_dir"]).iterdir()}
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

    assert pg.start() == dsn  # same cluster, same port, same password
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT v::text FROM survives").fetchone() == ("[1,2,3]",)


def test_logins_need_the_password(home, no_saved_passwords):
    pg = LocalPostgres.for_home(home, server_options=THROWAWAY_OPTIONS)
    dsn = pg.start()
    password = pg.password_file.read_text().strip()
    assert len(password) >= 32 and urlsplit(dsn).password == password
    st = pg.password_file.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()

    assert _refused(_without_password(dsn))
    assert _refused(dsn.replace(password, password[::-1]))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        settings = dict(conn.execute("SELECT name, setting FROM pg_settings WHERE name IN ('listen_addresses', "
                                     "'unix_socket_directories', 'unix_socket_permissions')").fetchall())
    data = pg.data_dir
    assert settings == {"listen_addresses": "127.0.0.1", "unix_socket_directories": str(data),
                        "unix_socket_permissions": "0700"}
    # The socket and its lock file lie in the cluster directory, which only the server's owner may enter;
    # and even through the socket the password is required.
    port = pg.status()["port"]
    assert (data / f".s.PGSQL.{port}").is_socket() and (data / f".s.PGSQL.{port}.lock").exists()
    assert not Path(f"/tmp/.s.PGSQL.{port}").exists()
    assert data.stat().st_mode & 0o777 == 0o700
    assert _refused("", host=str(data), port=port, user="postgres", dbname="postgres")
    psycopg.connect("", host=str(data), port=port, user="postgres", dbname="postgres", password=password).close()
    # The home is 0700, so even root's server user has its cluster elsewhere: nobody passes through here.
    assert pg.directory.stat().st_mode & 0o777 == 0o700

    pg.password_file.chmod(0o644)  # loosened by hand: the next start closes it again
    assert pg.start() == dsn and pg.password_file.stat().st_mode & 0o777 == 0o600


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
        # The password stays with the invoking user (root), out of the server user's reach.
        assert pg.password_file.parent == home / "postgres" and pg.password_file.stat().st_uid == 0
        assert (home / "postgres").stat().st_mode & 0o777 == 0o700
        assert _refused(_without_password(dsn))
    finally:
        pg.destroy()
    assert not data.exists()


@pytest.fixture
def old_home() -> Iterator[Path]:
    """A data directory whose cluster an older rag made: superuser without a password, trust for all."""
    home = Path(tempfile.mkdtemp(prefix="rag-db-old-", dir="/tmp"))
    home.chmod(0o755)
    data = home / "postgres" / "data"
    data.parent.mkdir()
    user = pg_runtime.server_user()
    pg_runtime.make_cluster_dir(data, user)
    initdb = pg_runtime.pginstall_for(user) / "bin" / "initdb"
    rc, out = pg_runtime.run([str(initdb), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                              "--no-locale", "--no-instructions", "--no-sync"], user, timeout=300)
    assert rc == 0, out
    yield home
    LocalPostgres.for_home(home).destroy()
    shutil.rmtree(home, ignore_errors=True)


def _start_the_old_way(home: Path) -> str:
    user = pg_runtime.server_user()
    data = home / "postgres" / "data"
    port = pg_runtime.free_port()
    pg_ctl = pg_runtime.pginstall_for(user) / "bin" / "pg_ctl"
    rc, out = pg_runtime.run([str(pg_ctl), "-D", str(data), "-l", str(data / "server.log"), "-w", "-o",
                              f"-p {port} -c listen_addresses=127.0.0.1 -k {data}", "start"], user, timeout=90)
    assert rc == 0, out
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def _trusts(home: Path) -> bool:
    hba = (home / "postgres" / "data" / "pg_hba.conf").read_text()
    return any("trust" in line.split("#", 1)[0].split() for line in hba.splitlines())


def test_a_trusting_cluster_is_secured_on_start(old_home, no_saved_passwords):
    old_dsn = _start_the_old_way(old_home)  # running, as an older `rag db start` left it
    with psycopg.connect(old_dsn, autocommit=True) as conn:  # anyone could log in: the hole being closed
        conn.execute("CREATE TABLE kept AS SELECT 'made before passwords' AS note")
    with pytest.raises(StoreError, match="no password file.*rag db start"):
        local_dsn(old_home)  # no password-less DSN handed out for it

    # The older rag also left the home open (0755): it is closed, but root's server user keeps its way
    # in to the cluster inside it (search permission only: nobody can list the home).
    assert stat.S_IMODE(old_home.stat().st_mode) == (0o711 if IS_ROOT else 0o700)
    pg = LocalPostgres.for_home(old_home, server_options=THROWAWAY_OPTIONS)
    dsn = pg.start()  # restarts it secured, on the same port
    assert _without_password(dsn) == old_dsn and urlsplit(dsn).password
    assert pg.data_dir == old_home / "postgres" / "data" and exposed_paths(old_home) == []
    assert _refused(old_dsn) and not _trusts(old_home)
    assert pg.password_file.stat().st_mode & 0o777 == 0o600
    with psycopg.connect(local_dsn(old_home)) as conn:
        assert conn.execute("SELECT note FROM kept").fetchone() == ("made before passwords",)

    # Stopped with trust back in pg_hba.conf and the password file gone: secured before it starts.
    assert pg.stop()
    hba = pg.data_dir / "pg_hba.conf"
    hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))
    pg.password_file.unlink()
    new_dsn = pg.start()
    assert new_dsn != dsn and not _trusts(old_home)
    assert _refused(old_dsn) and _refused(dsn)
    with psycopg.connect(new_dsn) as conn:
        assert conn.execute("SELECT note FROM kept").fetchone() == ("made before passwords",)


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    # --home on the top-level command, as users pass it: `rag --home DIR db ...`
    env = {k: v for k, v in os.environ.items() if k not in ("RAG_HOME", "RAG_DSN")}
    return subprocess.run(RAG + ["--home", str(home), "db", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_start_status_stop(home, monkeypatch):
    # Real processes: the server must outlive the `rag db start` that launched it.
    started = _cli(["start"], home)
    assert started.returncode == 0, started.stderr
    dsn = started.stdout.strip()
    assert dsn.startswith("postgresql://") and "running on port" in started.stderr
    password = (home / "postgres" / "password").read_text().strip()
    assert urlsplit(dsn).password == password  # whole, for `export RAG_DSN=$(rag db start)`
    status = json.loads(_cli(["status", "--json"], home).stdout)
    assert status["running"] and status["dsn"] == dsn and status["data_dir"] == str(_cluster_place(home))
    assert _not_owner_only(home) == [] and _not_owner_only(Path(status["data_dir"])) == []
    assert _vector_version(dsn) >= (0, 8)

    monkeypatch.setenv("RAG_HOME", str(home))
    run = CliRunner().invoke
    text = run(db_app, ["status"]).output
    assert text.startswith(f"PostgreSQL 18.6: running (pid {status['pid']})")
    assert password not in text and f"dsn:  {dsn.replace(password, '***')}\n" in text
    assert run(db_app, ["stop"]).output == "stopped\n"
    assert run(db_app, ["status"]).output.startswith("PostgreSQL 18.6: stopped")
    assert run(db_app, ["stop"]).output == "not running\n"


def test_cli_migrate_without_a_database_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    monkeypatch.delenv("RAG_DSN", raising=False)
    result = CliRunner().invoke(db_app, ["migrate"])
    assert isinstance(result.exception, ConfigError)
    assert "rag db start" in str(result.exception) and "--dsn" in str(result.exception)


def test_cli_migrate(pg_dsn, tmp_path, monkeypatch):
    pytest.importorskip("retrieval.stores.pgvector.schema")
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    result = CliRunner().invoke(db_app, ["migrate", "--dsn", pg_dsn])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("schema version ")
    monkeypatch.setenv("RAG_DSN", pg_dsn)  # the configured dsn is the default; migrating twice changes nothing
    again = CliRunner().invoke(db_app, ["migrate"])
    assert again.exit_code == 0 and again.output == result.output


def test_fixture_databases_are_isolated_and_dropped(pg_server, pg_dsn, no_saved_passwords):
    password = urlsplit(pg_server.dsn).password
    assert password and urlsplit(pg_dsn).password == password
    assert urlsplit(with_dbname(pg_server.dsn, "x")).password == password
    assert _refused(_without_password(pg_dsn))
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


@pytest.mark.slow
def test_cli_purge_leaves_no_deleted_text_in_the_local_servers_files(home):
    """`rag db purge` on the local server (started with wal_recycle=off) removes deleted text from its files."""
    import uuid

    import numpy as np

    from rag.types import Chunk, Document
    from retrieval.stores.pgvector.collection import create_collection

    dsn = _cli(["start"], home).stdout.strip()
    data_dir = Path(json.loads(_cli(["status", "--json"], home).stdout)["data_dir"])
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SHOW wal_recycle").fetchone() == ("off",)
    marker = "qz" + uuid.uuid4().hex[:12]
    coll = create_collection(dsn, f"c{uuid.uuid4().hex[:8]}", "test-embedder", "fp", 4, {})
    try:
        text = f"the {marker} incident plan"
        doc = Document(key="plan", source="lab/plan.md", text=text, content_hash="h", acl=frozenset({"group:x"}))
        coll.replace_document(doc, frozenset({"group:x"}), [Chunk("plan", 0, text, 4)],
                              np.ones((1, 4), dtype=np.float32) / 2)
        coll.delete_document("plan")
    finally:
        coll.close()
    purged = _cli(["purge"], home)
    assert purged.returncode == 0, purged.stderr
    assert "purged removed text" in purged.stdout and "***" in purged.stdout  # the password is not printed
    leftovers = []
    for path in data_dir.rglob("*"):
        try:
            if path.is_file() and marker.encode() in path.read_bytes():
                leftovers.append(path)
        except OSError:
            continue
    assert leftovers == []
    _cli(["stop"], home)
