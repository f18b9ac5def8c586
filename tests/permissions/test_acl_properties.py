"""Property-based tests of the ACL machinery: principals and entries, sidecar resolution, POSIX modes.

- Entries and principals: a principal reads exactly what its tokens meet; an entry that is not
  valid is refused (never read as something wider).
- Sidecars: random directory trees with random `.rag-acl.toml` files (allow lists, rules with
  globs, broken files, one above the ingest root) resolve as an independent reference model
  says, and a file whose resolution reaches a broken sidecar fails (it is never given an ACL).
- POSIX: for random modes and owners of a file and the directories above it, the kernel is the
  oracle: for each entry of the computed ACL, an identity it stands for really can open the
  file (a forked child with that uid/gid), and the owner, a group member and an outsider who
  are left out really cannot. These need root (to chown and to switch identity).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.sources import SourceItem, SourceProblem, walk_sources
from permissions.models import PUBLIC, Principal, make_acl, normalize_entry
from permissions.policy import store_filter
from permissions.sources import SIDECAR_NAME, AclResolver, SidecarError, posix_acl
from rag.errors import ConfigError
from tests.fuzz_corpus import ENTRIES, GROUPS, USERS, acls, principals, scaled, system_ids

# ------------------------------------------------------------------------ entries, principals


@settings(max_examples=scaled(100, 3000))
@given(principal=principals, acl=acls)
def test_a_principal_reads_exactly_what_its_tokens_meet(principal, acl):
    tokens = store_filter(principal)
    assert tokens == {PUBLIC, f"user:{principal.user}"} | {f"group:{g}" for g in principal.groups}
    assert principal.can_read(acl) == bool(tokens & acl)
    assert make_acl(acl) == acl  # canonical entries stay as they are
    assert not principal.can_read(frozenset())  # nobody reads an empty allow-list


_CANONICAL = re.compile(r"^(public|(user|group):[A-Za-z0-9_][A-Za-z0-9_.@+-]*)$")


@settings(max_examples=scaled(200, 5000))
@given(entry=st.one_of(
    st.text(max_size=20),
    st.builds("{}{}:{}{}".format, st.sampled_from(["", " "]), st.sampled_from(["user", "group", "User", "grp"]),
              st.text(max_size=8), st.sampled_from(["", " ", "\n"])),
    st.sampled_from(["public", "*", "everyone", " public ", "Public", "PUBLIC", "all", "", "user:", "group:*"]),
))
def test_an_entry_is_canonical_or_refused_never_widened(entry):
    try:
        got = normalize_entry(entry)
    except ConfigError:
        return
    assert _CANONICAL.match(got), got
    if got == PUBLIC:  # only the spellings of "everyone" mean everyone
        assert entry.strip() in ("public", "*", "everyone")
    else:
        kind, name = entry.strip().split(":", 1)
        assert got == f"{kind}:{name.strip()}"


# ------------------------------------------------------------------------------------ sidecars

# Glob patterns, each with what it means written independently of the glob translator: `rel`
# is the file's path relative to the sidecar's directory.
PATTERNS = {
    "*.md": lambda rel: "/" not in rel and rel.endswith(".md"),
    "**/*.txt": lambda rel: rel.endswith(".txt"),
    "a": lambda rel: rel == "a" or rel.startswith("a/"),
    "a/*": lambda rel: rel.startswith("a/"),
    "f?.md": lambda rel: re.fullmatch(r"f[^/]\.md", rel) is not None,
    "[ab]/**": lambda rel: rel[:2] in ("a/", "b/"),
    "**": lambda rel: True,
    "b/f1.md": lambda rel: rel == "b/f1.md",
}
BROKEN = ["allow = [", "allow = ['root:x']", "deny = ['public']", "allow = 'public'",
          "[[rule]]\nmatch = 'a'\n", "[[rule]]\nmatch = '../x'\nallow = []\n", "allow = ['user:']"]
DIRS = ["", "a", "b", "a/b", "c"]  # relative to the ingest root
FILES = ["f1.md", "a/f2.md", "a/x.txt", "b/f1.md", "a/b/f3.md", "a/b/y.txt", "c/fa.md", "c/g.txt"]


@st.composite
def sidecars(draw):
    """Either broken text, or (allow or None, [(pattern, acl), ...])."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.sampled_from(BROKEN))
    allow = draw(st.none() | acls)
    rules = draw(st.lists(st.tuples(st.sampled_from(sorted(PATTERNS)), acls), max_size=3))
    return allow, rules


def _toml(side) -> str:
    allow, rules = side
    lines = [] if allow is None else [f"allow = {json.dumps(sorted(allow))}"]
    for pattern, acl in rules:
        lines += ["[[rule]]", f"match = {json.dumps(pattern)}", f"allow = {json.dumps(sorted(acl))}"]
    return "\n".join(lines) + "\n"


def _expected(rel_file: str, tree: dict[str, object]) -> frozenset[str] | str | None:
    """The reference: nearest deciding sidecar's ACL, "broken" if a broken one is reached first,
    None when none decides (then POSIX applies). Keys of `tree`: directories relative to the
    ingest root, ".." being the directory above it."""
    parts = rel_file.split("/")
    chain = ["/".join(parts[:n]) for n in range(len(parts) - 1, -1, -1)] + [".."]
    for d in chain:
        side = tree.get(d)
        if side is None:
            continue
        if isinstance(side, str) or side == (None, []):  # an empty sidecar is an error, not a pass
            return "broken"
        rel = rel_file[len(d) + 1:] if d not in ("", "..") else ("root/" + rel_file if d == ".." else rel_file)
        allow, rules = side
        for pattern, acl in reversed(rules):
            if PATTERNS[pattern](rel):
                return acl
        if allow is not None:
            return allow
    return None


@settings(max_examples=scaled(60, 2000), deadline=None)
@given(tree=st.dictionaries(st.sampled_from([*DIRS, ".."]), sidecars(), max_size=4))
def test_sidecar_resolution_matches_the_reference_and_fails_closed(tree):
    base = Path(tempfile.mkdtemp(prefix="fuzz-acl-"))
    try:
        root = base / "root"
        for f in FILES:
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_text(f"text of {f}\n")
        for d, side in tree.items():
            where = base if d == ".." else root / d
            (where / SIDECAR_NAME).write_text(side if isinstance(side, str) else _toml(side))
        resolver = AclResolver(root)
        for f in FILES:
            want = _expected(f, tree)
            if want == "broken":
                with pytest.raises(SidecarError):
                    resolver.resolve(root / f)
                continue
            acl, origin = resolver.resolve(root / f)
            if want is None:
                assert origin == "posix" and acl == posix_acl(root / f, root), f
            else:
                assert origin.startswith("sidecar:") and acl == want, (f, origin)
        # What ingest sees: a file under a broken sidecar is a problem, or an item nobody may read.
        items = {str(Path(x.key).relative_to(root)): x for x in walk_sources([root])}
        for f in FILES:
            if _expected(f, tree) == "broken":
                assert isinstance(items[f], SourceProblem) or items[f].acl == frozenset(), f
            else:
                assert isinstance(items[f], SourceItem) and items[f].acl == resolver.resolve(root / f)[0], f
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------------------- POSIX

IDS = system_ids()
needs_root = pytest.mark.skipif(os.geteuid() != 0 or IDS is None,
                                reason="chown and identity switching need root (and the system accounts)")
_NOBODY_UID, _NO_GROUP = 2009, 3009  # an outsider: owns nothing, in no group a file here carries
_MEMBER_UID = 2008  # in the file's group only, owner of nothing

# Run in a fresh interpreter: for each identity, fork, drop to it, try to open the file.
_PROBE = r"""
import json, os, sys
path, identities = json.loads(sys.argv[1])
out = []
for uid, gid, groups in identities:
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(groups); os.setgid(gid); os.setuid(uid)
            with open(path, "rb") as f:
                f.read(1)
            os._exit(0)
        except OSError:
            os._exit(1)
    out.append(os.waitpid(pid, 0)[1] == 0)
print(json.dumps(out))
"""


def _can_open(path: Path, identities: list[tuple[int, int, list[int]]]) -> list[bool]:
    r = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, json.dumps([str(path), identities])],
                       capture_output=True, text=True, check=True, timeout=60)
    return json.loads(r.stdout)


owners = st.tuples(st.sampled_from(USERS), st.sampled_from(GROUPS))


@needs_root
@settings(max_examples=scaled(40, 1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file_mode=st.integers(0, 0o777), dir_modes=st.lists(st.integers(0, 0o777), min_size=2, max_size=2),
       file_owner=owners, dir_owners=st.lists(owners, min_size=2, max_size=2))
def test_posix_acl_entries_are_what_the_kernel_allows(file_mode, dir_modes, file_owner, dir_owners):
    uids, gids = IDS
    base = Path(tempfile.mkdtemp(prefix="fuzz-posix-"))
    try:
        os.chmod(base, 0o755)  # above the ingest root: not part of the ACL, so let everyone through
        root, sub = base / "root", base / "root" / "sub"
        sub.mkdir(parents=True)
        path = sub / "f.md"
        path.write_text("x\n")
        for p, mode, (user, group) in [(path, file_mode, file_owner), (root, dir_modes[0], dir_owners[0]),
                                       (sub, dir_modes[1], dir_owners[1])]:
            os.chown(p, uids[user], gids[group])
            os.chmod(p, mode)
        acl = posix_acl(path, root)
        user, group = file_owner
        owner = pwd.getpwnam(user)
        identities = {
            PUBLIC: (_NOBODY_UID, _NO_GROUP, []),
            f"group:{group}": (_MEMBER_UID, gids[group], [gids[group]]),
            f"user:{user}": (owner.pw_uid, owner.pw_gid, os.getgrouplist(user, owner.pw_gid)),
        }
        allowed = dict(zip(identities, _can_open(path, list(identities.values())), strict=True))
        for entry, can in allowed.items():
            # Sound (an entry is someone who really can read) and complete for these identities.
            assert (entry in acl) == can, (entry, oct(file_mode), [oct(m) for m in dir_modes], sorted(acl))
        assert acl <= set(identities), sorted(acl)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_probe_really_switches_identity():
    """The kernel oracle above is worth something only if a dropped identity is really refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    base = Path(tempfile.mkdtemp(prefix="fuzz-posix-"))
    try:
        os.chmod(base, 0o755)
        path = base / "secret.md"
        path.write_text("x\n")
        os.chmod(path, 0o600)
        assert _can_open(path, [(_NOBODY_UID, _NO_GROUP, []), (0, 0, [])]) == [False, True]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_entries_list_covers_the_pools():
    assert len(ENTRIES) == 1 + len(USERS) + len(GROUPS)
    assert all(Principal(u).can_read({f"user:{u}"}) for u in USERS)
