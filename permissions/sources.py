"""Where a file's ACL comes from: `.rag-acl.toml` sidecar files, else its POSIX permissions.

Sidecar format
--------------
A file named `.rag-acl.toml` in a directory says who may read the files in that directory
and below; it overrides POSIX permissions::

    # who may read the files in this directory and below (overrides POSIX)
    allow = ["group:genomics", "user:alice"]

    # optional per-file overrides; `match` is a glob against the path relative to this directory
    [[rule]]
    match = "private/*.md"
    allow = ["user:alice"]

- `allow` and each rule's `allow` are lists of ACL entries: "public", "user:NAME",
  "group:NAME". `allow = []` means nobody: the file is stored, but no query returns it.
- `match` globs: `*` and `?` stay inside one path segment, `**` spans directories
  (`**/*.pdf` is every PDF below), `[abc]` is a character class. A pattern that matches a
  directory governs everything below it (`match = "private"`).
- Only the keys `allow` and `rule` (and, in a rule, `match` and `allow`) are accepted.
- A sidecar with neither `allow` nor any rule (an empty or truncated file) is an error: it
  was put there to decide, and passing over it would hand its files a wider ACL.

Resolution for a file F: visit F's directory, then its parents, up to the filesystem root.
The nearest sidecar that decides for F wins: its last rule whose `match` matches F, else its
`allow`. A sidecar with neither for F is passed over. If no sidecar decides, POSIX applies.
Sidecars above the ingest root count too: "this directory and below" still holds when someone
ingests only a subdirectory, and dropping a restrictive parent sidecar could only widen access.

A sidecar that cannot be used (bad TOML, unknown keys, bad entries, unreadable, not a regular
file) makes every file whose resolution reaches it fail with `SidecarError`: the ACL of such
files cannot be determined, and callers must deny them (ingest stores them with an empty ACL
until the sidecar is fixed), never give them the (possibly more permissive) POSIX ACL, nor
keep an older ACL that the sidecar may have been changed to narrow.

POSIX
-----
Owner, group and other read bits of the file give "user:OWNER", "group:GROUP", "public".
Reading a file also needs search (x) permission on every directory on its path, so an entry
is dropped when a directory between the file and the ingest root (inclusive) denies it that,
by the class of bits POSIX applies: "public" needs o+x; "group:G" needs g+x on a directory
whose group is G and o+x on others; the owner needs u+x on directories they own, else g+x on
those of one of their groups, else o+x. (Group ACLs are allow-lists, so a mode that denies
the group but allows others, like 0604, still lets group members read through "public".)
Directories above the ingest root are not checked: corpora are often staged under a private
directory (a 0700 home, a service account's spool) whose mode says nothing about the
documents' audience, and that would otherwise turn every ACL into "admins only".
An owner or group with no name on this machine (no passwd/group entry, or a name the ACL syntax
rejects) raises `PosixNameError` unless the file is public anyway: a numeric stand-in such as
"user:1234" could name somebody else in the user directory.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

from permissions.models import PUBLIC, make_acl, normalize_entry
from rag.errors import ConfigError

SIDECAR_NAME = ".rag-acl.toml"


class AclError(ConfigError):
    """A file's ACL cannot be determined: nobody may read it until the cause is fixed."""


class SidecarError(AclError):
    """A `.rag-acl.toml` file cannot be used; nobody may read the files it would govern."""


class PosixNameError(AclError):
    """A file's owner or group has no usable name on this machine, so its POSIX ACL is unknown."""


# ---------------------------------------------------------------------------------- POSIX


def posix_acl(path: Path, root: Path | None = None) -> frozenset[str]:
    """The ACL that POSIX permissions give `path` (see the module docstring).

    Args:
        path: the file.
        root: the ingest root; directories from the file's parent up to it (inclusive) are
            checked for search permission. None checks no directory.

    Returns:
        A frozenset of "user:NAME", "group:NAME" and/or "public" (may be empty).

    Raises:
        OSError: the file (or a directory on the way) cannot be stat'ed.
        PosixNameError: the owner or group that may read it has no usable name (not public).
    """
    return _PosixAcl().acl(path, root)


class _PosixAcl:
    """POSIX ACL computation with cached name and directory lookups."""

    def __init__(self) -> None:
        self._dir_stats: dict[Path, os.stat_result] = {}
        self._user_groups: dict[int, frozenset[int]] = {}

    def acl(self, path: Path, root: Path | None) -> frozenset[str]:
        st = path.stat()
        mode = st.st_mode
        can_owner = bool(mode & stat.S_IRUSR)
        can_group = bool(mode & stat.S_IRGRP)
        can_other = bool(mode & stat.S_IROTH)
        for d in _dirs_between(path.parent, root):
            ds = self._dir_stat(d)
            # POSIX uses exactly one class of bits per process: owner, else group, else other.
            can_other = can_other and bool(ds.st_mode & stat.S_IXOTH)
            if can_group:
                bit = stat.S_IXGRP if ds.st_gid == st.st_gid else stat.S_IXOTH
                can_group = bool(ds.st_mode & bit)
            if can_owner:
                can_owner = self._owner_can_search(st.st_uid, ds)
        acl: set[str] = {PUBLIC} if can_other else set()
        if can_owner:
            acl |= _named_entry(path, "user", st.st_uid, is_public=can_other)
        if can_group:
            acl |= _named_entry(path, "group", st.st_gid, is_public=can_other)
        return frozenset(acl)

    def _dir_stat(self, d: Path) -> os.stat_result:
        if d not in self._dir_stats:
            self._dir_stats[d] = d.stat()
        return self._dir_stats[d]

    def _owner_can_search(self, uid: int, ds: os.stat_result) -> bool:
        if ds.st_uid == uid:
            return bool(ds.st_mode & stat.S_IXUSR)
        if ds.st_gid in self._groups_of(uid):
            return bool(ds.st_mode & stat.S_IXGRP)
        return bool(ds.st_mode & stat.S_IXOTH)

    def _groups_of(self, uid: int) -> frozenset[int]:
        if uid not in self._user_groups:
            try:
                pw = pwd.getpwuid(uid)
                # getgrouplist asks NSS for one user; getgrall would enumerate a whole LDAP.
                groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
            except (KeyError, OSError):
                groups = frozenset()
            self._user_groups[uid] = groups
        return self._user_groups[uid]


def _dirs_between(start: Path, root: Path | None) -> list[Path]:
    """Directories from `start` up to `root` inclusive (empty when root is None or not above)."""
    if root is None:
        return []
    if start != root and root not in start.parents:
        return []
    dirs = [start]
    while dirs[-1] != root:
        dirs.append(dirs[-1].parent)
    return dirs


def _named_entry(path: Path, kind: str, num: int, is_public: bool) -> set[str]:
    """{"user:NAME"} / {"group:NAME"} for a uid / gid.

    One with no usable name is left out of a public file's ACL (everyone may read it anyway)
    and raises PosixNameError otherwise.
    """
    try:
        name = pwd.getpwuid(num).pw_name if kind == "user" else grp.getgrgid(num).gr_name
        return {normalize_entry(f"{kind}:{name}")}
    except KeyError:
        if is_public:
            return set()
        why = "has no name on this machine (no passwd/group entry)"
    except ConfigError as e:
        if is_public:
            return set()
        why = f"has a name the ACL syntax rejects ({e})"
    what = "owner uid" if kind == "user" else "group gid"
    raise PosixNameError(
        f"cannot determine the POSIX ACL of {path}: its {what} {num} {why}; nobody may read it "
        f"until it is fixed: add a sidecar {SIDECAR_NAME} with allow = [...], or chown/chgrp it")


# -------------------------------------------------------------------------------- sidecars


@dataclass(frozen=True)
class _Rule:
    pattern: str
    regex: re.Pattern[str]
    acl: frozenset[str]


@dataclass(frozen=True)
class Sidecar:
    """A parsed `.rag-acl.toml`: a default allow-list and per-path rules."""

    path: Path
    allow: frozenset[str] | None
    rules: tuple[_Rule, ...]

    def decide(self, rel: str) -> tuple[frozenset[str], str] | None:
        """The ACL and origin this sidecar gives the file at `rel` (relative to its directory)."""
        for n in range(len(self.rules), 0, -1):  # the last matching rule wins
            rule = self.rules[n - 1]
            if _matches(rule.regex, rel):
                return rule.acl, f"sidecar:{self.path}#rule{n}"
        if self.allow is not None:
            return self.allow, f"sidecar:{self.path}"
        return None


def load_sidecar(path: Path) -> Sidecar:
    """Parse and check one sidecar file.

    Raises:
        SidecarError: unreadable file, bad TOML, unknown keys or bad ACL entries.
    """
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SidecarError(_sidecar_msg(path, f"bad TOML: {e}")) from e
    except OSError as e:
        raise SidecarError(_sidecar_msg(path, f"cannot read: {e.strerror or e}")) from e
    unknown = sorted(set(data) - {"allow", "rule"})
    if unknown:
        raise SidecarError(_sidecar_msg(path, f"unknown keys {unknown}; use 'allow' and [[rule]]"))
    allow = _acl_field(path, data["allow"], "allow") if "allow" in data else None
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise SidecarError(_sidecar_msg(path, "'rule' must be an array of tables ([[rule]])"))
    if allow is None and not raw_rules:
        # Empty or truncated: passing over it would give its files a parent's or POSIX's ACL.
        raise SidecarError(_sidecar_msg(path, "it has neither 'allow' nor any [[rule]]: write "
                                              "allow = [...] (allow = [] for nobody), or delete it"))
    rules: list[_Rule] = []
    for n, raw in enumerate(raw_rules, 1):
        where = f"rule {n}"
        if not isinstance(raw, dict):
            raise SidecarError(_sidecar_msg(path, f"{where} must be a table ([[rule]])"))
        unknown = sorted(set(raw) - {"match", "allow"})
        if unknown:
            raise SidecarError(_sidecar_msg(path, f"{where}: unknown keys {unknown}"))
        if "match" not in raw or "allow" not in raw:
            raise SidecarError(_sidecar_msg(path, f"{where} needs both 'match' and 'allow'"))
        pattern = raw["match"]
        if not isinstance(pattern, str) or not pattern.strip("/"):
            raise SidecarError(_sidecar_msg(path, f"{where}: 'match' must be a non-empty glob"))
        if pattern.startswith("/") or ".." in pattern.split("/"):
            raise SidecarError(
                _sidecar_msg(path, f"{where}: 'match' is relative to the sidecar's directory "
                                   f"and may not start with / or contain '..': {pattern!r}")
            )
        acl = _acl_field(path, raw["allow"], f"{where} 'allow'")
        rules.append(_Rule(pattern, _glob_regex(pattern.strip("/")), acl))
    return Sidecar(path=path, allow=allow, rules=tuple(rules))


def _acl_field(path: Path, value: object, what: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise SidecarError(_sidecar_msg(path, f"{what} must be a list of ACL entries"))
    try:
        return make_acl(value)
    except ConfigError as e:
        raise SidecarError(_sidecar_msg(path, f"{what}: {e}")) from e


def _sidecar_msg(path: Path, problem: str) -> str:
    return f"unusable ACL file {path}: {problem} (nobody may read the files it governs until it is fixed)"


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Translate a path glob: `*`/`?` within a segment, `**` across segments, `[...]` classes."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (j := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out))


def _matches(regex: re.Pattern[str], rel: str) -> bool:
    """True when the glob matches `rel` or one of its leading directories."""
    if regex.fullmatch(rel):
        return True
    parts = rel.split("/")
    return any(regex.fullmatch("/".join(parts[:k])) for k in range(1, len(parts)))


# -------------------------------------------------------------------------------- resolver


class AclResolver:
    """Resolves files' ACLs under one ingest root, caching sidecars and directory lookups."""

    def __init__(self, root: Path) -> None:
        """Args: root: the ingest root (a directory, or a single file: then its directory)."""
        root = Path(os.path.abspath(root))
        self.root = root.parent if root.is_file() else root
        self._sidecars: dict[Path, Sidecar | SidecarError | None] = {}
        self._posix = _PosixAcl()

    def resolve(self, path: Path) -> tuple[frozenset[str], str]:
        """The ACL of the file at `path` and where it came from.

        Returns:
            (acl, origin): origin is "posix", "sidecar:/abs/.rag-acl.toml" or
            "sidecar:/abs/.rag-acl.toml#ruleN" (N counts the [[rule]] tables from 1).

        Raises:
            SidecarError: the sidecar that would decide cannot be used.
            PosixNameError: POSIX decides, and names an owner or group that has no usable name.
            OSError: the file cannot be stat'ed (POSIX case).
        """
        path = Path(os.path.abspath(path))
        d = path.parent
        while True:
            sidecar = self._sidecar(d)
            if isinstance(sidecar, SidecarError):
                # A fresh exception each time: re-raising the cached one would grow its traceback.
                raise SidecarError(str(sidecar))
            if sidecar is not None:
                decision = sidecar.decide(path.relative_to(d).as_posix())
                if decision is not None:
                    return decision
            if d.parent == d:
                break
            d = d.parent
        return self._posix.acl(path, self.root), "posix"

    def _sidecar(self, d: Path) -> Sidecar | SidecarError | None:
        if d not in self._sidecars:
            p = d / SIDECAR_NAME
            try:
                present = _sidecar_present(p)
            except SidecarError as e:
                self._sidecars[d] = e
            else:
                if not present:
                    self._sidecars[d] = None
                else:
                    try:
                        self._sidecars[d] = load_sidecar(p)
                    except SidecarError as e:
                        self._sidecars[d] = e
        return self._sidecars[d]


def _sidecar_present(p: Path) -> bool:
    """Whether a sidecar file is at `p`; SidecarError when that cannot be told for sure.

    Only "nothing at all by that name" counts as absent: a directory, a FIFO or a dangling
    symlink named like a sidecar was meant to decide, and guessing "no sidecar" could widen access.
    """
    try:
        st = p.stat()
    except FileNotFoundError:
        try:
            p.lstat()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise SidecarError(_sidecar_msg(p, f"cannot check: {e}")) from e
        raise SidecarError(_sidecar_msg(p, "it is a symbolic link to nothing")) from None
    except OSError as e:  # e.g. EACCES on the directory
        raise SidecarError(_sidecar_msg(p, f"cannot check: {e}")) from e
    if not stat.S_ISREG(st.st_mode):
        raise SidecarError(_sidecar_msg(p, "it is not a regular file"))
    return True
