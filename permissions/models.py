"""Principals and ACLs: who is asking, and who may read a document.

An ACL is a frozenset of principal strings: "user:NAME", "group:NAME" or "public".
A principal may read a document when its own principal strings meet the ACL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from rag.errors import ConfigError

PUBLIC = "public"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]*$")


def check_name(name: str, what: str = "name") -> str:
    """Return `name` if it is a valid user or group name, else raise ConfigError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"invalid {what} {name!r}: use letters, digits and . _ - + @ (not starting with . - + @)"
        )
    return name


def normalize_entry(entry: str) -> str:
    """Check one ACL entry and return it in canonical form.

    Accepts "public", "user:NAME", "group:NAME" (and "*" or "everyone" as "public").
    """
    if not isinstance(entry, str):
        raise ConfigError(f"ACL entries must be strings, got {entry!r}")
    e = entry.strip()
    if e in ("public", "*", "everyone"):
        return PUBLIC
    kind, sep, name = e.partition(":")
    if not sep or kind not in ("user", "group"):
        raise ConfigError(
            f"invalid ACL entry {entry!r}: use 'public', 'user:NAME' or 'group:NAME'"
        )
    return f"{kind}:{check_name(name.strip(), kind)}"


def make_acl(entries: Iterable[str]) -> frozenset[str]:
    """Build a canonical ACL from entries, checking each one."""
    return frozenset(normalize_entry(e) for e in entries)


@dataclass(frozen=True)
class Principal:
    """Who is asking: a user and the groups they belong to."""

    user: str
    groups: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        check_name(self.user, "user")
        for g in self.groups:
            check_name(g, "group")
        object.__setattr__(self, "groups", frozenset(self.groups))

    def tokens(self) -> frozenset[str]:
        """The ACL entries that grant this principal access."""
        return frozenset({PUBLIC, f"user:{self.user}"} | {f"group:{g}" for g in self.groups})

    def can_read(self, acl: Iterable[str]) -> bool:
        """True when the ACL names this user, one of their groups, or public."""
        return not self.tokens().isdisjoint(acl)
