"""Owner-only files: the data directory and everything written into it, whatever the umask.

The data directory holds every chunk's text (also from 0600 sources), API key hashes, the audit
log and the PostgreSQL password, so on a shared login node nobody but its owner may read, list or
write anything in it. The library never changes the process umask (a notebook user's other files
are theirs to decide): it creates each file 0600 and each directory 0700 instead, modes the umask
can only narrow. Stdlib only (and rag.errors), so every package may use it, like rag.atomic.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rag.errors import ConfigError

logger = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# A directory on the way to something another user owns (the local PostgreSQL cluster, which
# root runs as `rag-postgres`): that user must pass through it, nobody may list it.
PASS_THROUGH_DIR_MODE = 0o711
_GROUP_OTHER = 0o077
_GROUP_OTHER_READ_WRITE = 0o066
# What rag puts in a data directory (rag/settings.py, rag/audit.py, rag/local_postgres/server.py, rag/shards/run.py,
# ingest/staging.py, rag/experiments/variants.py). An open directory is tightened only if it holds
# nothing else (an operator's rag.toml, a models link) or a marker says it is a data directory, and
# then only these entries in it, so a mistaken `--home ~` never rewrites a user's files.
HOME_ENTRIES = frozenset({
    "catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm", "catalog.sqlite-journal",
    "indexes", "models", "shards", "staging", "postgres", "audit.jsonl", "rag.toml", "experiments"})
_HOME_MARKERS = ("catalog.sqlite", "postgres/state.json", "postgres/password", "postgres/data")


def is_exposed(mode: int) -> bool:
    """Whether a file or directory of this mode lets other users read, list or change it.

    Only the search bit (x) left for others is not exposure: they may pass through to a path
    they know, as the PostgreSQL server user must, but can neither list nor read.
    """
    return bool(mode & _GROUP_OTHER_READ_WRITE)


def ensure_private_dir(path: Path, *, fix: bool = True) -> Path:
    """The data directory `path`: created 0700 if missing, checked (and tightened) if it exists.

    An existing data directory that others may read or list is made owner-only, with everything
    rag keeps in it (HOME_ENTRIES, `make_tree_private`), and a loud warning, since what was in it
    may have been read already; with `fix=False` it is refused instead. An empty one (made with
    `mkdir` for rag) just becomes 0700. A directory anyone may write to (/tmp), or one holding
    files but no data directory (a mistaken `--home ~`), is refused rather than changed.

    Args:
        path: the directory (a symlink to it is followed: data often lives on scratch).
        fix: tighten an exposed directory (True) or refuse it (False).

    Returns:
        `path`.

    Raises:
        ConfigError: `path` is not a directory, belongs to another user, or is exposed and not `fix`.
    """
    path = Path(path)
    if not os.path.lexists(path):
        private_mkdir(path)
        return path
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"cannot use data directory {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"data directory {path} is not a directory: pass another --home (or RAG_HOME)")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"data directory {path} belongs to {_user_name(st.st_uid)}, not to you ({_user_name(os.geteuid())}): "
            "run rag as its owner (e.g. `sudo -u OWNER rag ...` for a service account's directory), or use "
            "a data directory of your own (--home or RAG_HOME)")
    if not is_exposed(st.st_mode):
        return path
    mode = stat.filemode(st.st_mode)
    if st.st_mode & (stat.S_ISVTX | stat.S_IWOTH):
        raise ConfigError(f"data directory {path} is a directory anyone may write to (mode {mode}), like /tmp: "
                          "use a directory of your own (--home or RAG_HOME), e.g. ~/.rag")
    names = os.listdir(path)
    if not names:
        os.chmod(path, PRIVATE_DIR_MODE)  # nothing in it was ever exposed
        return path
    is_home = set(names) <= HOME_ENTRIES or any(os.path.lexists(path / marker) for marker in _HOME_MARKERS)
    if not is_home:
        raise ConfigError(f"{path} is open to other users (mode {mode}) and holds files that are not a rag data "
                          "directory: pass a new or empty directory as --home (or RAG_HOME), or make this one "
                          f"owner-only yourself (chmod 700 {path})")
    if not fix:
        raise ConfigError(
            f"data directory {path} is open to other users (mode {mode}): they can read every document's text "
            f"in it. Run `chmod -R go-rwx {path}` and check who had access, or set home_permissions = \"fix\" "
            "(RAG_HOME_PERMISSIONS=fix) to let rag do that")
    changed, leads_to_foreign = 0, False
    for name in names:
        if name in HOME_ENTRIES:
            n, foreign = _tighten_tree(path / name)
            changed, leads_to_foreign = changed + n, leads_to_foreign or foreign
    os.chmod(path, PASS_THROUGH_DIR_MODE if leads_to_foreign else stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER)
    others = sorted(set(names) - HOME_ENTRIES)
    logger.warning(
        "data directory %s was open to other users (mode %s): made it and everything rag keeps in it owner-only "
        "(%d more modes changed)%s. Other users may have read what was in it before now; check who had "
        "access.", path, mode, changed,
        f"; other files in it are left as they are, now out of others' reach: {', '.join(others)}" if others else "")
    return path


def private_mkdir(path: Path) -> Path:
    """`mkdir -p path` whose new directories are 0700; existing ones are left as they are."""
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            pass  # another process made it at the same moment; is_dir() below still checks
    if not path.is_dir():
        raise ConfigError(f"{path} exists but is not a directory: move it aside")
    return path


def create_private_file(path: Path) -> Path:
    """Make sure `path` exists and is 0600 before a library that would create it with the umask's
    mode opens it (SQLite, Faiss); an existing file of ours is tightened.

    SQLite gives its -wal and -shm files the mode of the database file, so they are 0600 too.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        _tighten_fd(fd)
    finally:
        os.close(fd)
    return Path(path)


def create_private_sqlite_file(path: Path) -> Path:
    """`create_private_file` for a SQLite database that this process may already have open.

    Closing any file descriptor of a file drops every POSIX lock the process holds on it, and
    SQLite's locks are POSIX locks: opening and closing the database file beside a live connection
    (another thread's, or the identity store's on the catalog file) lets another process believe
    nobody has it open, checkpoint and remove the WAL under us ("disk I/O error"). So an existing
    file is tightened by path, never opened; a new one is created exclusively, before any
    connection to it can exist.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except FileExistsError:
        st = os.stat(path)
        if st.st_uid == os.geteuid() and st.st_mode & _GROUP_OTHER:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER)
        return Path(path)
    try:
        _tighten_fd(fd)
    finally:
        os.close(fd)
    return Path(path)


def open_private(path: Path, mode: str = "w", *, append: bool = False, encoding: str | None = None) -> IO:
    """Open `path` for writing, created 0600 (an existing file of ours is tightened first).

    Args:
        mode: "w" (text) or "wb" (binary); the file is truncated unless `append`.
        append: O_APPEND instead of truncating (lock files, logs).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', not {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        _tighten_fd(fd)
        return os.fdopen(fd, ("a" if append else "w") + ("b" if mode == "wb" else ""),
                         encoding=None if mode == "wb" else (encoding or "utf-8"))
    except BaseException:
        os.close(fd)
        raise


def write_private_text(path: Path, text: str) -> None:
    """Write `text` to `path`, which is 0600 from the moment it exists."""
    with open_private(path) as f:
        f.write(text)


def make_tree_private(root: Path) -> int:
    """Take group and other access off `root` and everything under it that we own.

    Symlinks are neither followed nor changed, and another user's entries are left alone (root
    must not rewrite the PostgreSQL server user's cluster); a directory on the way to such an entry
    becomes 0711 so that user can still reach it. Returns how many entries changed mode.
    """
    changed, _ = _tighten_tree(Path(root))
    return changed


def exposed_paths(root: Path) -> list[Path]:
    """Every path under `root` (itself included) that other users may read, list or change.

    Symlinks are not counted (their own mode means nothing; what they point to is checked where it lies).
    """
    return [p for p, st in _walk(Path(root)) if not stat.S_ISLNK(st.st_mode) and is_exposed(st.st_mode)]


def _tighten_tree(path: Path) -> tuple[int, bool]:
    """(entries changed, whether `path` is or leads to an entry of another user)."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return 0, False
    if st.st_uid != os.geteuid():
        return 0, True
    changed, leads_to_foreign = 0, False
    if stat.S_ISDIR(st.st_mode):
        with os.scandir(path) as entries:
            children = [Path(e.path) for e in entries]
        for child in children:
            n, foreign = _tighten_tree(child)
            changed += n
            leads_to_foreign = leads_to_foreign or foreign
        wanted = PASS_THROUGH_DIR_MODE if leads_to_foreign else stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER
    else:
        wanted = stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER
    if wanted != stat.S_IMODE(st.st_mode):
        os.chmod(path, wanted)
        changed += 1
    return changed, leads_to_foreign


def _walk(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    st = root.lstat()
    yield root, st
    if stat.S_ISDIR(st.st_mode):
        try:
            with os.scandir(root) as entries:
                children = [Path(e.path) for e in entries]
        except PermissionError:
            return  # another user's directory that we cannot enter: its own mode was reported
        for child in children:
            yield from _walk(child)


def _tighten_fd(fd: int) -> None:
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_mode & _GROUP_OTHER:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
