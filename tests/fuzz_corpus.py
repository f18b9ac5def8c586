"""Random corpora, ACLs, principals and queries for the property-based leak tests (hypothesis).

Every document version carries a marker word that occurs nowhere else (`marker(3, 1)` is
"qz3k1w"), in every one of its chunks: a leak of unreadable text, in any output (hits,
citations, answers, error bodies, document fetches), is then a plain substring check.

User and group names are system accounts that every Debian-like machine has (daemon, bin, sys,
lp; news, uucp, proxy), none of them a member of another's group: the same names serve as POSIX
owners and groups of files on disk (the POSIX ACL source names them "user:bin", "group:news"),
so one principal pool covers sidecars, JSONL records and file modes alike.
"""

from __future__ import annotations

import grp
import hashlib
import pwd
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from permissions.models import PUBLIC, Principal

USERS = ("daemon", "bin", "sys", "lp")
GROUPS = ("news", "uucp", "proxy")
OUTSIDER = "outsider"  # a user no ACL ever names
ENTRIES = (PUBLIC, *(f"user:{u}" for u in USERS), *(f"group:{g}" for g in GROUPS))
FILLER = ("sample buffer freezer cluster node queue protocol reagent microscope sequencer storage "
          "backup quota partition pipeline centrifuge aliquot seminar grant login script").split()
# Text that has tripped query parsers elsewhere: FTS5 / tsquery syntax, quotes, odd Unicode.
NASTY = ['"', "NEAR(", "OR", "AND NOT", "*", "text:", "-", "'", "\\", "(", ")", ":", "^", "%", "_",
         "ß", "İ", "\u0301", "日本", "\u200b", "\x00"]


def system_ids() -> tuple[dict[str, int], dict[str, int]] | None:
    """uid of each of USERS and gid of each of GROUPS, or None when this machine lacks one."""
    try:
        return ({u: pwd.getpwnam(u).pw_uid for u in USERS}, {g: grp.getgrnam(g).gr_gid for g in GROUPS})
    except KeyError:
        return None


def scaled(default: int, slow: int) -> int:
    """An example count: `default` in the quick profile, `slow` under HYPOTHESIS_PROFILE=slow."""
    return slow if settings.get_current_profile_name() == "slow" else default


def marker(doc: int, version: int) -> str:
    """The word planted in every chunk of one version of one document (no marker contains another)."""
    return f"qz{doc}k{version}w"


# ------------------------------------------------------------------------------ strategies

acls = st.frozensets(st.sampled_from(ENTRIES), max_size=3)
"""A random allow-list; empty (nobody) is as likely as any other size."""

principals = st.builds(
    Principal,
    user=st.sampled_from((*USERS, OUTSIDER)),
    groups=st.frozensets(st.sampled_from(GROUPS), max_size=2),
)

filler_words = st.lists(st.sampled_from(FILLER), min_size=3, max_size=12).map(" ".join)


def chunk_texts(draw: st.DrawFn, mark: str, max_chunks: int = 3) -> list[str]:
    """One to `max_chunks` chunk texts, each with the document's marker somewhere in it."""
    n = draw(st.integers(1, max_chunks))
    texts = []
    for _ in range(n):
        words = draw(filler_words).split()
        words.insert(draw(st.integers(0, len(words))), mark)
        texts.append(" ".join(words))
    return texts


def queries(corpus: Reference) -> st.SearchStrategy[str]:
    """Questions aimed at the corpus: exact phrases and markers of any document (readable or not,
    current or gone), filler, and query-parser syntax."""
    options: list[st.SearchStrategy[str]] = [
        filler_words,
        st.lists(st.sampled_from(NASTY + FILLER), min_size=1, max_size=6).map(" ".join),
        st.text(min_size=1, max_size=30),
    ]
    texts = [t for d in corpus.docs.values() for t in d.texts]
    marks = sorted(corpus.all_markers())
    if texts:
        options.append(st.sampled_from(texts))  # an exact phrase of a (maybe unreadable) chunk
        options.append(st.sampled_from(texts).map(lambda t: f'"{t}"'))
    if marks:
        options.append(st.sampled_from(marks))
        options.append(st.lists(st.sampled_from(marks), min_size=2, max_size=4).map(" OR ".join))
    return st.one_of(options)


# ----------------------------------------------------------------------- the reference model


@dataclass
class DocState:
    acl: frozenset[str]
    texts: list[str]
    mark: str


@dataclass
class Reference:
    """What the corpus holds, kept apart from any store: who may read what, and what is gone."""

    docs: dict[str, DocState] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # markers of deleted or replaced versions

    def put(self, key: str, acl: frozenset[str], texts: list[str], mark: str) -> None:
        old = self.docs.get(key)
        if old is not None and old.mark != mark:
            self.gone.add(old.mark)
        self.docs[key] = DocState(acl, texts, mark)

    def delete(self, key: str) -> None:
        old = self.docs.pop(key, None)
        if old is not None:
            self.gone.add(old.mark)

    def all_markers(self) -> set[str]:
        return {d.mark for d in self.docs.values()} | self.gone

    def readable_keys(self, principal: Principal) -> set[str]:
        return {k for k, d in self.docs.items() if principal.can_read(d.acl)}

    def forbidden_markers(self, principal: Principal) -> set[str]:
        """Markers `principal` must never see: unreadable documents' and every gone version's."""
        return {d.mark for d in self.docs.values() if not principal.can_read(d.acl)} | self.gone

    def leaks(self, principal: Principal, shown: str | Iterable[str]) -> set[str]:
        """The forbidden markers that occur in `shown` (empty when nothing leaked)."""
        text = shown if isinstance(shown, str) else "\n".join(shown)
        return {m for m in self.forbidden_markers(principal) if m in text}

    def readable_chunks(self, principal: Principal) -> set[tuple[str, int]]:
        return {(k, i) for k, d in self.docs.items() if principal.can_read(d.acl)
                for i in range(len(d.texts))}


# --------------------------------------------------------------------- a stand-in embedder

DIM = 32


def hash_embed(texts: Iterable[str], dim: int = DIM) -> np.ndarray:
    """Bag-of-words vectors from word hashes: texts sharing words score high, so a query that is
    an unreadable chunk's exact text points straight at it (the adversarial case), at no model cost."""
    rows = []
    for text in texts:
        v = np.zeros(dim, dtype=np.float32)
        for word in text.lower().split():
            h = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            v[h[0] % dim] += 1.0 if h[1] & 1 else -1.0
        norm = float(np.linalg.norm(v))
        if norm == 0.0:
            v[0], norm = 1.0, 1.0
        rows.append(v / norm)
    return np.stack(rows) if rows else np.zeros((0, dim), dtype=np.float32)
