"""What happens to stored documents an ingest run did not find: deleted, or held when unsure.

A document is gone only when the walk could have found it and did not. When the walk could
not look (a directory it cannot list, a JSONL file with unreadable lines or one that stopped
reading part-way), the documents there are held: kept, readable by nobody until a later run
can see them again. A deletion that would take too large a share of the collection at once is
refused by the DeletionGuard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ingest.acl_changes import AclProblem
from ingest.deletion_guard import DeletionGuard, DeletionRefusal
from ingest.sources import COVERS_AGAIN, COVERS_RECORDS, COVERS_TREE, SourceProblem, is_under
from rag.errors import NotFoundError
from retrieval.base import CollectionStore
from retrieval.records import DocumentState

NOBODY = frozenset[str]()


class Holds:
    """The problems of a walk that speak for documents it did not yield."""

    def __init__(self) -> None:
        self._files: dict[str, SourceProblem] = {}  # JSONL file path -> problem
        self._trees: list[SourceProblem] = []
        self._ambiguous: dict[str, SourceProblem] = {}  # key -> a second source for it

    def add(self, problem: SourceProblem) -> None:
        if problem.covers == COVERS_RECORDS:
            self._files.setdefault(str(problem.path), problem)
        elif problem.covers == COVERS_TREE:
            self._trees.append(problem)
        elif problem.covers == COVERS_AGAIN:
            self._ambiguous.setdefault(problem.key, problem)

    def restrict_ambiguous(self, index: CollectionStore, is_mine: Callable[[str], bool]) -> list[AclProblem]:
        """Make documents with two sources in one walk readable by nobody; call once all is written."""
        out = []
        for key, problem in sorted(self._ambiguous.items()):
            if is_mine(key):
                restrict(index, key, NOBODY)
                out.append(AclProblem(key, f"readable by nobody until it has one source: {problem.reason}"))
        return out

    def covering(self, key: str) -> SourceProblem | None:
        """The problem that holds the stored document `key`, if any."""
        path, _, record = key.partition("#")
        if record and path in self._files:
            return self._files[path]
        return next((p for p in self._trees if is_under(key, p.path)), None)


@dataclass
class VanishedOutcome:
    deleted: int = 0
    held: list[AclProblem] = field(default_factory=list)
    refusal: DeletionRefusal | None = None


def settle_vanished(index: CollectionStore, vanished: dict[str, DocumentState], holds: Holds,
                    guard: DeletionGuard, num_documents: int) -> VanishedOutcome:
    """Delete the documents that are gone, and make the held ones readable by nobody.

    Args:
        vanished: stored documents in this run's scope (its roots, its shard) the walk did not yield.
        num_documents: the documents this run could delete from, for the guard's fraction.
    """
    out = VanishedOutcome()
    gone = []
    for key in sorted(vanished):
        problem = holds.covering(key)
        if problem is None:
            gone.append(key)
            continue
        if vanished[key].acl != NOBODY:
            restrict(index, key, NOBODY)
        out.held.append(AclProblem(key, f"kept, readable by nobody until it can be read again: "
                                        f"{problem.reason}"))
    out.refusal = guard.refusal(len(gone), num_documents)
    if out.refusal is None:
        for key in gone:
            index.delete_document(key)
        out.deleted = len(gone)
    return out


def restrict(index: CollectionStore, key: str, acl: frozenset[str]) -> None:
    """Set a stored document's ACL; one that a rebuild has not copied yet changes where it lives."""
    try:
        index.set_acl(key, acl)
    except NotFoundError:
        # A CollectionBuild applies the ACL to the live version first; the build has none yet.
        pass
