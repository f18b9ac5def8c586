"""Where ACLs come from: POSIX modes (with directory search rights) and .rag-acl.toml sidecars."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from permissions.sources import AclResolver, PosixNameError, SidecarError, load_sidecar, posix_acl
from rag.errors import ConfigError
from tests.unprivileged import run_unprivileged, searchable_dir

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to other users needs root")


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An ingest root anyone may search (pytest's tmp_path itself is 0700)."""
    d = tmp_path / "root"
    d.mkdir(mode=0o755)
    d.chmod(0o755)  # mkdir's mode is filtered by the umask
    return d


def me() -> tuple[str, str]:
    st_uid, st_gid = os.geteuid(), os.getegid()
    return f"user:{pwd.getpwuid(st_uid).pw_name}", f"group:{grp.getgrgid(st_gid).gr_name}"


# ---------------------------------------------------------------------------------- POSIX


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        (0o600, {"u"}), (0o640, {"u", "g"}), (0o644, {"u", "g", "public"}),
        (0o604, {"u", "public"}), (0o040, {"g"}), (0o000, set()), (0o200, set()),
    ],
)
def test_posix_mode_bits(root: Path, mode: int, want: set[str]) -> None:
    f = write(root / "f.md")
    f.chmod(mode)
    user, group = me()
    names = {"u": user, "g": group, "public": "public"}
    assert posix_acl(f, root) == frozenset(names[w] for w in want)


@needs_root
def test_posix_names_and_no_numeric_fallback(tmp_path: Path) -> None:
    f = write(tmp_path / "f.md")
    f.chmod(0o640)
    os.chown(f, 65534, 65534)
    assert posix_acl(f) == frozenset({
        f"user:{pwd.getpwuid(65534).pw_name}", f"group:{grp.getgrgid(65534).gr_name}"})
    unknown = 54321
    with pytest.raises(KeyError):
        pwd.getpwuid(unknown)
    os.chown(f, unknown, unknown)
    # A numeric stand-in ("user:54321") could name another registered user: no guessing.
    with pytest.raises(PosixNameError, match="owner uid 54321 has no name"):
        posix_acl(f)
    f.chmod(0o600)  # only the owner may read: only their name is needed
    with pytest.raises(PosixNameError, match="owner uid 54321"):
        posix_acl(f)
    os.chown(f, 65534, unknown)
    f.chmod(0o640)
    with pytest.raises(PosixNameError, match="group gid 54321"):
        posix_acl(f)
    # Public anyway: the unnamed entries would add nobody, so they are left out.
    os.chown(f, unknown, unknown)
    f.chmod(0o644)
    assert posix_acl(f) == frozenset({"public"})


@pytest.mark.parametrize(
    ("dir_mode", "want"),
    [
        (0o755, {"u", "g", "public"}),
        (0o751, {"u", "g", "public"}),  # x without r is enough to open a known path
        (0o750, {"u", "g"}),
        (0o754, {"u", "g"}),  # r without x is not
        (0o700, {"u"}),
        (0o000, set()),
        # One class of bits applies per user: the owner's own u bits even when o+x is set.
        (0o705, {"u", "public"}),
        (0o055, {"g", "public"}),
    ],
)
def test_parent_directory_search_rights(root: Path, dir_mode: int, want: set[str]) -> None:
    f = write(root / "private" / "deep" / "f.md")
    f.chmod(0o644)
    (root / "private").chmod(dir_mode)
    try:
        user, group = me()
        names = {"u": user, "g": group, "public": "public"}
        assert posix_acl(f, root) == frozenset(names[w] for w in want)
    finally:
        (root / "private").chmod(0o755)


def test_directories_above_the_root_are_not_checked(root: Path) -> None:
    inner = root / "inner"
    f = write(inner / "f.md")
    f.chmod(0o644)
    inner.chmod(0o755)
    root.chmod(0o700)
    try:
        assert "public" in posix_acl(f, inner)
        assert "public" not in posix_acl(f, root)  # the root itself must be searchable too
    finally:
        root.chmod(0o755)


@needs_root
def test_group_needs_search_on_a_directory_of_another_group(root: Path) -> None:
    f = write(root / "d" / "f.md")
    f.chmod(0o640)
    os.chown(f, 0, 0)
    d = root / "d"
    d.chmod(0o750)
    os.chown(d, 0, 65534)  # the directory's group is not the file's group
    assert posix_acl(f, root) == frozenset({"user:root"})
    os.chown(d, 0, 0)
    assert posix_acl(f, root) == frozenset({"user:root", "group:root"})


@needs_root
def test_owner_needs_search_on_someone_elses_directory(root: Path) -> None:
    f = write(root / "d" / "f.md")
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    d = root / "d"
    d.chmod(0o700)  # only root may enter
    assert posix_acl(f, root) == frozenset()
    os.chown(d, 65534, 0)
    assert posix_acl(f, root) == frozenset({f"user:{pwd.getpwuid(65534).pw_name}"})


def test_resolver_uses_posix_without_sidecars(tmp_path: Path) -> None:
    f = write(tmp_path / "a" / "f.md")
    f.chmod(0o600)
    acl, origin = AclResolver(tmp_path).resolve(f)
    assert origin == "posix" and acl == frozenset({me()[0]})


# -------------------------------------------------------------------------------- sidecars


def sidecar(d: Path, text: str) -> Path:
    return write(d / ".rag-acl.toml", text)


def test_sidecar_overrides_posix_and_is_inherited(tmp_path: Path) -> None:
    sc = sidecar(tmp_path, 'allow = ["group:genomics", "user:alice"]\n')
    f = write(tmp_path / "a" / "b" / "f.md")
    f.chmod(0o644)
    acl, origin = AclResolver(tmp_path).resolve(f)
    assert acl == frozenset({"group:genomics", "user:alice"})
    assert origin == f"sidecar:{sc}"


def test_nearest_sidecar_wins(tmp_path: Path) -> None:
    sidecar(tmp_path, 'allow = ["public"]\n')
    inner = sidecar(tmp_path / "lab", 'allow = ["group:lab"]\n')
    r = AclResolver(tmp_path)
    assert r.resolve(write(tmp_path / "top.md"))[0] == frozenset({"public"})
    assert r.resolve(write(tmp_path / "lab" / "x.md")) == (frozenset({"group:lab"}),
                                                           f"sidecar:{inner}")
    assert r.resolve(write(tmp_path / "lab" / "sub" / "y.md"))[0] == frozenset({"group:lab"})


def test_rules_last_match_wins_and_globs(tmp_path: Path) -> None:
    sc = sidecar(tmp_path, """
allow = ["group:genomics"]

[[rule]]
match = "restricted/*.md"
allow = ["user:alice"]

[[rule]]
match = "restricted/budget-*.md"
allow = ["user:alice", "user:pi"]

[[rule]]
match = "**/*.pdf"
allow = ["group:readers"]

[[rule]]
match = "archive"
allow = []
""")
    r = AclResolver(tmp_path)

    def acl(rel: str) -> tuple[frozenset[str], str]:
        return r.resolve(write(tmp_path / rel))

    assert acl("restricted/notes.md") == (frozenset({"user:alice"}), f"sidecar:{sc}#rule1")
    assert acl("restricted/budget-2025.md") == (frozenset({"user:alice", "user:pi"}),
                                                f"sidecar:{sc}#rule2")
    # `*` stays inside one directory level: a deeper file falls back to `allow`.
    assert acl("restricted/old/notes.md")[0] == frozenset({"group:genomics"})
    assert acl("restricted/notes.txt")[0] == frozenset({"group:genomics"})
    # `**/` matches any depth, including none.
    assert acl("report.pdf")[0] == frozenset({"group:readers"})
    assert acl("a/b/c/report.pdf")[0] == frozenset({"group:readers"})
    # A pattern naming a directory governs everything below it; `allow = []` is nobody.
    assert acl("archive/2019/old.md") == (frozenset(), f"sidecar:{sc}#rule4")


def test_sidecar_without_decision_is_passed_over(tmp_path: Path) -> None:
    outer = sidecar(tmp_path, 'allow = ["group:all"]\n')
    sidecar(tmp_path / "d", '[[rule]]\nmatch = "secret.md"\nallow = ["user:bob"]\n')
    r = AclResolver(tmp_path)
    assert r.resolve(write(tmp_path / "d" / "secret.md"))[0] == frozenset({"user:bob"})
    assert r.resolve(write(tmp_path / "d" / "other.md")) == (frozenset({"group:all"}),
                                                             f"sidecar:{outer}")


def test_rules_only_sidecar_falls_back_to_posix(tmp_path: Path) -> None:
    sidecar(tmp_path, '[[rule]]\nmatch = "secret.md"\nallow = ["user:bob"]\n')
    f = write(tmp_path / "open.md")
    f.chmod(0o600)
    assert AclResolver(tmp_path).resolve(f) == (frozenset({me()[0]}), "posix")


def test_empty_allow_means_nobody_not_posix(tmp_path: Path) -> None:
    sc = sidecar(tmp_path, "allow = []\n")
    f = write(tmp_path / "f.md")
    f.chmod(0o644)
    assert AclResolver(tmp_path).resolve(f) == (frozenset(), f"sidecar:{sc}")


def test_entries_are_normalized(tmp_path: Path) -> None:
    sidecar(tmp_path, 'allow = [" group:lab ", "everyone"]\n')
    assert AclResolver(tmp_path).resolve(write(tmp_path / "f.md"))[0] == frozenset(
        {"group:lab", "public"})


def test_sidecar_above_the_ingest_root_still_applies(tmp_path: Path) -> None:
    # Ingesting only a subdirectory must not escape a restrictive sidecar above it.
    sc = sidecar(tmp_path, 'allow = ["group:genomics"]\n')
    f = write(tmp_path / "sub" / "f.md")
    f.chmod(0o644)
    assert AclResolver(tmp_path / "sub").resolve(f) == (frozenset({"group:genomics"}),
                                                        f"sidecar:{sc}")
    assert AclResolver(f).resolve(f)[0] == frozenset({"group:genomics"})  # a single-file root


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('allow = ["group:genomics"\n', "bad TOML"),
        ('allow = ["group:genomics"]\ndeny = ["user:bob"]\n', "unknown keys ['deny']"),
        ('allow = ["admins"]\n', "invalid ACL entry 'admins'"),
        ('allow = "group:genomics"\n', "must be a list"),
        ('[[rule]]\nallow = ["user:a"]\n', "needs both 'match' and 'allow'"),
        ('[[rule]]\nmatch = "x"\nallow = ["user:a"]\nusers = []\n', "unknown keys ['users']"),
        ('[[rule]]\nmatch = "../x.md"\nallow = ["user:a"]\n', "may not start with / or contain"),
        ('[[rule]]\nmatch = ""\nallow = ["user:a"]\n', "non-empty glob"),
        ('[rule]\nmatch = "x"\nallow = ["user:a"]\n', "array of tables"),
        ('Allow = ["group:genomics"]\n', "unknown keys ['Allow']"),  # a typo'd key
        ("", "neither 'allow' nor any [[rule]]"),  # empty or truncated
        ("# allow = []\n", "neither 'allow' nor any [[rule]]"),
    ],
)
def test_broken_sidecar_never_falls_back(tmp_path: Path, text: str, fragment: str) -> None:
    sc = sidecar(tmp_path, text)
    f = write(tmp_path / "sub" / "f.md")
    f.chmod(0o644)  # POSIX would say "public": exactly what must not happen
    r = AclResolver(tmp_path)
    with pytest.raises(SidecarError) as e:
        r.resolve(f)
    assert str(sc) in str(e.value) and fragment in str(e.value)
    assert isinstance(e.value, ConfigError)
    with pytest.raises(SidecarError):  # cached, still refused
        r.resolve(f)
    with pytest.raises(SidecarError):
        load_sidecar(sc)


def test_broken_parent_sidecar_behind_a_deciding_one(tmp_path: Path) -> None:
    # The nearest deciding sidecar wins before the broken parent is even consulted;
    # files that do reach the broken one are refused.
    sidecar(tmp_path, "allow = [oops\n")
    sidecar(tmp_path / "ok", 'allow = ["group:lab"]\n')
    r = AclResolver(tmp_path)
    assert r.resolve(write(tmp_path / "ok" / "f.md"))[0] == frozenset({"group:lab"})
    with pytest.raises(SidecarError):
        r.resolve(write(tmp_path / "other" / "f.md"))


def test_sidecar_that_cannot_be_checked_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # If whether a sidecar exists cannot be told (EACCES on stat), the answer must not
    # silently become "no sidecar, use POSIX".
    f = write(tmp_path / "d" / "f.md")
    f.chmod(0o644)
    blocked = tmp_path / "d" / ".rag-acl.toml"
    real_stat = Path.stat

    def stat(self: Path, *args: object, **kwargs: object) -> os.stat_result:
        if self == blocked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(SidecarError, match="cannot check"):
        AclResolver(tmp_path).resolve(f)


@pytest.mark.parametrize("kind", ["directory", "dangling symlink", "fifo"])
def test_something_named_like_a_sidecar_is_not_absent(tmp_path: Path, kind: str) -> None:
    # Only "nothing by that name" means no sidecar: anything else was put there to decide.
    f = write(tmp_path / "f.md")
    f.chmod(0o644)
    p = tmp_path / ".rag-acl.toml"
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to(tmp_path / "moved-away.toml")
    with pytest.raises(SidecarError, match="symbolic link to nothing|not a regular file"):
        AclResolver(tmp_path).resolve(f)


def test_unreadable_sidecar_is_refused() -> None:
    # A real denial, as root too (CI runs as root, who reads anything): the check runs as nobody.
    with searchable_dir() as d:
        f = write(d / "f.md")
        f.chmod(0o644)
        sidecar(d, 'allow = ["user:alice"]\n').chmod(0o000)
        out = run_unprivileged(
            "import sys\nfrom pathlib import Path\nfrom permissions.sources import AclResolver, SidecarError",
            "f = Path(sys.argv[1])\n"
            "f.read_text()  # the document is readable: only its sidecar is denied\n"
            "try:\n"
            "    print('resolved:', AclResolver(f.parent).resolve(f))\n"
            "except SidecarError as e:\n"
            "    print('refused:', e)\n",
            str(f))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and "cannot read: Permission denied" in out.stdout, out.stdout
