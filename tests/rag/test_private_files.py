"""The data directory and everything in it are owner-only, whatever the umask (issue 13, item 1).

Homes are made under umask 022, the usual default, through the Python API and the real CLI; then
the whole tree is walked. CI runs as root, who reads anything: the tests assert on modes, and show
with a real unprivileged user (`runuser -u nobody`) that others cannot read or list.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rag.api.app import create_app
from rag.errors import ConfigError
from rag.pipeline import Rag
from rag.private_files import create_private_file, ensure_private_dir, exposed_paths, make_tree_private
from rag.settings import load_settings
from retrieval.stores.embedded.catalog import Catalog
from tests.rag.live_server import serving

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]
IS_ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A world-traversable directory (pytest's own are 0700): what a home in $HOME or /scratch sits in."""
    parent = Path(tempfile.mkdtemp(prefix="rag-private-", dir="/tmp"))
    parent.chmod(0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def not_owner_only(root: Path) -> list[str]:
    """Every file and directory under `root` (itself included) that gives group or others any access."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for path in [Path(dirpath)] + [Path(dirpath) / n for n in dirnames + filenames]:
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                bad.append(f"{path.relative_to(root)} {stat.filemode(st.st_mode)}")
    return sorted(set(bad))


def _nobody() -> str | None:
    """An unprivileged user to read as, where we may switch to one."""
    if not IS_ROOT or shutil.which("runuser") is None:
        return None
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return None
    return "nobody"


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], cwd="/", capture_output=True, text=True,
                          timeout=30)


# -- the module on its own -----------------------------------------------------------------


def test_a_new_home_and_its_missing_parents_are_created_0700(open_parent):
    home = ensure_private_dir(open_parent / "lab" / "rag-home")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE(home.parent.stat().st_mode) == 0o700  # made by us, for our data
    assert stat.S_IMODE(open_parent.stat().st_mode) == 0o755  # not ours to change


def test_sqlite_files_are_0600_wal_and_shm_included(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    catalog.create_collection("c", "emb", "fp", 4, {"max_tokens": 16, "overlap_tokens": 0})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {"catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"} <= set(files), files
    assert not_owner_only(tmp_path) == [], files
    catalog.close()


def test_create_private_file_tightens_a_file_others_could_read(tmp_path):
    f = tmp_path / "index.faiss.tmp"
    f.write_text("old")
    f.chmod(0o644)
    create_private_file(f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.read_text() == "old"


def _open_old_home(home: Path) -> None:
    """A home as an older rag left it under umask 022: 0755 directories, 0644 files."""
    (home / "indexes").mkdir(parents=True)
    Catalog(home / "catalog.sqlite").close()
    for name in ("audit.jsonl", "indexes/default.v3.faiss"):
        (home / name).write_text("text of a 0600 source")
    for path in (home, home / "indexes"):
        path.chmod(0o755)
    for path in (home / "catalog.sqlite", home / "audit.jsonl", home / "indexes" / "default.v3.faiss"):
        path.chmod(0o644)
    assert len(exposed_paths(home)) == 5


def test_an_open_home_is_made_owner_only_with_a_loud_warning(open_parent, caplog):
    home = open_parent / "home"
    _open_old_home(home)
    (home / "notes.txt").write_text("the operator's own file")  # not rag's: left alone, named in the warning

    with caplog.at_level(logging.WARNING, logger="rag.private_files"):
        rag = Rag(load_settings(home=home))
    rag.close()
    assert not_owner_only(home) == ["notes.txt -rw-r--r--"]  # out of others' reach inside the 0700 home
    warning = next(r for r in caplog.records if r.name == "rag.private_files")
    assert warning.levelno == logging.WARNING and str(home) in warning.getMessage()
    assert "may have read" in warning.getMessage() and "notes.txt" in warning.getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rag.private_files"):
        Rag(load_settings(home=home)).close()
    assert not caplog.records  # once fixed, nothing more to say


def test_an_open_home_is_refused_when_so_configured(open_parent, monkeypatch):
    home = open_parent / "home"
    _open_old_home(home)
    monkeypatch.setenv("RAG_HOME_PERMISSIONS", "refuse")
    with pytest.raises(ConfigError, match=r"open to other users.*chmod -R go-rwx") as e:
        Rag(load_settings(home=home))
    assert str(home) in str(e.value)
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # left for the operator to look at
    assert stat.S_IMODE((home / "catalog.sqlite").stat().st_mode) == 0o644


def test_rag_db_refuses_an_open_home_when_so_configured(open_parent, monkeypatch):
    from typer.testing import CliRunner

    from rag.cli.db import db_app
    home = open_parent / "home"
    _open_old_home(home)
    monkeypatch.setenv("RAG_HOME", str(home))
    monkeypatch.setenv("RAG_HOME_PERMISSIONS", "refuse")
    result = CliRunner().invoke(db_app, ["status"])
    assert isinstance(result.exception, ConfigError) and "open to other users" in str(result.exception)
    assert stat.S_IMODE(home.stat().st_mode) == 0o755  # not tightened behind the setting's back


def test_an_engine_key_file_others_can_read_is_warned_about(tmp_path, caplog):
    from rag.cli.engine import _read_key
    key_file = tmp_path / "engine-key"
    key_file.write_text("s3cret\n")
    key_file.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert _read_key(None, key_file) == "s3cret"
    assert any("readable by other users" in r.getMessage() and "chmod 600" in r.getMessage() for r in caplog.records)
    caplog.clear()
    key_file.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        _read_key(None, key_file)
    assert not caplog.records


def test_an_empty_open_directory_just_becomes_0700(open_parent, caplog):
    home = open_parent / "home"
    home.mkdir()  # what `mkdir home` gives under umask 022
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
    with caplog.at_level(logging.WARNING, logger="rag.private_files"):
        Rag(load_settings(home=home)).close()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and not caplog.records  # nothing was ever exposed in it


def test_a_prepared_open_directory_is_taken_as_a_data_directory(open_parent):
    """`mkdir home; vi home/rag.toml`: the operator's settings file is rag's, the directory too."""
    home = open_parent / "home"
    home.mkdir()
    (home / "rag.toml").write_text('collection = "lab"\n')
    assert stat.S_IMODE((home / "rag.toml").stat().st_mode) == 0o644
    rag = Rag(load_settings(home=home))
    assert rag.settings.collection == "lab"
    rag.close()
    assert not_owner_only(home) == []


def test_a_mistaken_home_is_refused_and_left_as_it_is(open_parent):
    """`--home ~` or `--home /tmp`: rag must not rewrite the modes of a user's own files."""
    user_home = open_parent / "alice"
    (user_home / "public_html").mkdir(parents=True)
    (user_home / "models").mkdir()  # a name rag uses too; public_html is not, so this is no data directory
    (user_home / "public_html" / "index.html").write_text("hello")
    for path in (user_home, user_home / "public_html", user_home / "models"):
        path.chmod(0o755)
    before = {p: p.stat().st_mode for p in user_home.rglob("*")} | {user_home: user_home.stat().st_mode}
    with pytest.raises(ConfigError, match="not a rag data directory.*new or empty directory"):
        Rag(load_settings(home=user_home))
    assert {p: p.stat().st_mode for p in before} == before and not (user_home / "catalog.sqlite").exists()

    shared = open_parent / "scratch"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ConfigError, match="anyone may write to.*like /tmp"):
        Rag(load_settings(home=shared))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_another_users_directory_is_refused(open_parent):
    if IS_ROOT:
        home = open_parent / "theirs"
        home.mkdir(mode=0o700)
        nobody = pwd.getpwnam("nobody")
        os.chown(home, nobody.pw_uid, nobody.pw_gid)
        owner = "nobody"
    else:
        home, owner = Path("/"), "root"
    with pytest.raises(ConfigError, match=f"belongs to {owner}, not to you"):
        Rag(load_settings(home=home))


def test_the_fixup_follows_no_symlink_and_keeps_a_foreign_cluster_reachable(open_parent):
    outside = open_parent / "outside.txt"
    outside.write_text("not ours to change")
    outside.chmod(0o644)
    home = open_parent / "home"
    (home / "postgres" / "data").mkdir(parents=True)
    (home / "link").symlink_to(outside)
    for d in (home, home / "postgres", home / "postgres" / "data"):
        d.chmod(0o755)
    if IS_ROOT:  # the local PostgreSQL cluster, which root runs as another user
        nobody = pwd.getpwnam("nobody")
        os.chown(home / "postgres" / "data", nobody.pw_uid, nobody.pw_gid)
    make_tree_private(home)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    if IS_ROOT:
        # That user may pass through to its cluster, nobody may list; the cluster is not ours to change.
        assert stat.S_IMODE(home.stat().st_mode) == stat.S_IMODE((home / "postgres").stat().st_mode) == 0o711
        assert stat.S_IMODE((home / "postgres" / "data").stat().st_mode) == 0o755
        assert exposed_paths(home) == [home / "postgres" / "data"]
    else:
        assert not_owner_only(home) == []


# -- whole homes, made the way users make them -----------------------------------------------


@pytest.mark.slow
def test_python_api_home_is_owner_only_after_ingest_shards_and_the_service(open_parent, lab_copy):
    """Ingest, a sharded ingest and its merge, users and keys, a converted reranker, the audit log."""
    from rag.shards.merge import merge_shards
    from rag.shards.run import ingest_shard

    home = open_parent / "home"
    rag = Rag(load_settings(home=home, max_new_tokens=8))
    try:
        assert rag.ingest([lab_copy]).ok
        for shard in range(2):
            assert ingest_shard(rag, [lab_copy], "sharded", shard, 2).report.ok
        merge_shards(rag, "sharded", keep_shards=True)
        rag.identity.add_user("alice", ["genomics"])
        key = rag.identity.create_key("alice", [])
    finally:
        rag.close()
    assert (home / "shards" / "sharded" / "0-of-2" / "catalog.sqlite").exists()

    app = create_app(load_settings(home=home), preload=False)
    with serving(app) as url:
        r = httpx.post(f"{url}/v1/query", json={"question": "How do I submit a GPU job?", "generate": False},
                       headers={"Authorization": f"Bearer {key}"}, timeout=300)
        assert r.status_code == 200, r.text
    assert (home / "audit.jsonl").exists() and any((home / "models" / "reranker").iterdir())
    assert any(p.suffix == ".faiss" for p in (home / "indexes").iterdir())

    assert not_owner_only(home) == []
    if _nobody():
        # What the modes mean: another local user can neither read the catalog nor list the home.
        assert _as_nobody("cat", str(home / "catalog.sqlite")).returncode != 0
        assert _as_nobody("ls", str(home)).returncode != 0
        assert _as_nobody("ls", str(open_parent)).returncode == 0  # the test itself could reach it


@pytest.mark.slow
def test_cli_home_is_owner_only(open_parent, lab_copy, model_cache):
    home = open_parent / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAG_")}
    # The session's converted models (the Python API test above converts its own into its home).
    ensure_private_dir(home)
    (home / "models").symlink_to(model_cache, target_is_directory=True)

    def rag(*args: str) -> str:
        r = subprocess.run(RAG + ["--home", str(home), *args], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout

    # Shard directories and their merge are the API test's above (the CLI runs the same code);
    # here each kind of CLI command that writes the home, one process each.
    rag("ingest", str(lab_copy))
    rag("users", "add", "alice", "--group", "genomics")
    rag("keys", "create", "--user", "alice")
    rag("query", "--as", "alice", "--no-generate", "How do I submit a GPU job?")
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert not_owner_only(home) == []
    if _nobody():
        assert _as_nobody("cat", str(home / "catalog.sqlite")).returncode != 0


def test_preparing_an_open_database_keeps_the_processes_sqlite_locks(tmp_path):
    """Opening and closing the catalog file beside a live connection dropped this process's POSIX
    locks: another process then took the file for unused, emptied the WAL, and the next new
    connection here failed with "disk I/O error" (a `rag query` beside a running service did it)."""
    import subprocess
    import sys
    import threading

    from permissions.identity import IdentityStore

    db = tmp_path / "catalog.sqlite"
    ids = IdentityStore(db)
    ids.add_user("alice", ["genomics"])
    other = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA journal_mode=WAL');"
             " c.execute('CREATE TABLE IF NOT EXISTS t (x)'); c.execute('INSERT INTO t VALUES (1)'); c.commit();"
             " c.close()")
    IdentityStore(db).close()  # a second store on the same file, as Rag opens catalog + identity
    assert subprocess.run([sys.executable, "-c", other, str(db)]).returncode == 0
    ids.create_key("bob", ["imaging"])
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(ids.principal_for("alice", ())))
    thread.start()
    thread.join()
    assert len(seen) == 1 and "genomics" in seen[0].groups
    ids.close()
