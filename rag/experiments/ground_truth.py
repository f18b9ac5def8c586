"""Permission-aware ground truth: what a question's asker may read, decided by the stored ACLs.

Labels say which sources answer a question; whether the asker may read them is what the
ingested documents' ACLs say now (sidecars, POSIX modes, JSONL `acl` fields, as ingest stored
them), not what the label's author believed. So:

- a relevant source the asker may not read is not a miss: it leaves the question's relevant set;
- a question none of whose answer sources the asker may read must be refused;
- a hit from a document the asker may not read is a leak. So is a hit from a document the
  store does not know (fail closed) and a hit the label lists as `forbidden`.

A label that matches no stored document counts as unreadable (an ACL that cannot be
determined denies) and is reported, since it is more often a typo than a permission.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rag.experiments.metrics import matches
from rag.experiments.questions import Question
from rag.types import Hit
from retrieval.records import DocumentState


def label_of(document_key: str, root: Path) -> str:
    """A stored document key as labels write it: the path under `root`, plus '#record' for JSONL."""
    path, _, record = document_key.partition("#")
    try:
        rel = Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        rel = path
    return f"{rel}#{record}" if record else rel


@dataclass(frozen=True)
class Truth:
    """One question's ground truth for its asker."""

    relevant: frozenset[str]  # answer sources the asker may read: the ones retrieval must find
    unreadable: frozenset[str]  # answer sources the asker may not read: never misses
    unknown: frozenset[str]  # labels that match no stored document (counted as unreadable)

    @property
    def should_refuse(self) -> bool:
        return not self.relevant


class StoredAcls:
    """The ACL of every stored document of a collection, by label."""

    def __init__(self, states: dict[str, DocumentState], root: str | Path) -> None:
        self.root = Path(root)
        self._by_label = {label_of(key, self.root): state.acl for key, state in states.items()}
        # A label may name a whole JSONL file: the ACLs of its records, by the file's label.
        self._by_file: dict[str, list[frozenset[str]]] = {}
        for label, acl in self._by_label.items():
            file, _, record = label.partition("#")
            if record:
                self._by_file.setdefault(file, []).append(acl)

    def acls_of(self, label: str) -> list[frozenset[str]]:
        """The stored ACLs a label covers: its document's, or those of a labelled file's records."""
        own = self._by_label.get(label)
        return ([own] if own is not None else []) + self._by_file.get(label, [])

    def truth(self, question: Question) -> Truth:
        principal = question.principal
        relevant, unreadable, unknown = set(), set(), set()
        for label in question.sources:
            acls = self.acls_of(label)
            if not acls:
                unknown.add(label)
                unreadable.add(label)
            # A labelled JSONL file is readable when one of its records is: a hit from that
            # record is then a correct find, and the other records leak if they come back.
            elif any(principal.can_read(acl) for acl in acls):
                relevant.add(label)
            else:
                unreadable.add(label)
        return Truth(frozenset(relevant), frozenset(unreadable), frozenset(unknown))

    def leaks(self, question: Question, hits: list[Hit]) -> list[str]:
        """Labels of the hits the asker may not read, in rank order (an empty list is the only good answer)."""
        principal = question.principal
        out = []
        for hit in hits:
            label = label_of(hit.document_key, self.root)
            stored = self._by_label.get(label)
            readable = (stored is not None and principal.can_read(stored) and principal.can_read(hit.acl)
                        and not any(matches(label, f) for f in question.forbidden))
            if not readable:
                out.append(label)
        return out
