"""ACL changes an ingest run must report: documents whose ACL widened or cannot be determined."""

from __future__ import annotations

from dataclasses import dataclass

from permissions.models import PUBLIC


@dataclass(frozen=True)
class AclProblem:
    """A document stored (or kept) readable by nobody, because its ACL cannot be determined."""

    source: str  # the document key
    error: str

    def as_dict(self) -> dict[str, str]:
        return {"source": self.source, "error": self.error}


@dataclass(frozen=True)
class Widening:
    """A stored document that more principals may read after this run than before it."""

    source: str
    before: frozenset[str]
    after: frozenset[str]

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "before": sorted(self.before), "after": sorted(self.after)}


def widens(before: frozenset[str], after: frozenset[str]) -> bool:
    """Whether `after` lets in a principal that `before` kept out.

    Judged by entries, not by who is in which group today (the directory may change later): any
    new entry widens, unless "public" already let everyone in. A deleted sidecar that hands a
    file its wider POSIX ACL, or a fixed sidecar that lifts the deny-all of an ACL error, widens.
    """
    return PUBLIC not in before and not after <= before
