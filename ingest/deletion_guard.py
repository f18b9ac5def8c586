"""The guard against wiping a collection by accident: an empty root, or too many deletions at once.

An unmounted NFS/Lustre mount or a moved directory looks, to a walk, exactly like "every file
was deleted". So a run refuses (before it changes anything) when a root that has documents in
the collection yields no source at all, and deletes nothing when it would delete more than
`max_fraction` of the collection's documents, unless the operator said `allow_mass_delete`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ingest.sources import is_under
from rag.errors import IngestError

DEFAULT_MAX_DELETE_FRACTION = 0.5


class MassDeleteError(IngestError):
    """A run would delete every document under a root that yields no sources."""


@dataclass(frozen=True)
class DeletionRefusal:
    """Deletions a run held back: too large a share of the collection at once."""

    would_delete: int
    documents: int  # the documents this run could delete from (of its shard, if sharded)
    max_fraction: float

    def message(self) -> str:
        return (f"refused to delete {self.would_delete} of {self.documents} documents (more than "
                f"{self.max_fraction:.0%}; nothing was deleted): if the sources are really gone, run "
                "again with --allow-mass-delete, or raise --max-delete-fraction / max_delete_fraction")

    def as_dict(self) -> dict[str, object]:
        return {"would_delete": self.would_delete, "documents": self.documents,
                "max_fraction": self.max_fraction, "message": self.message()}


@dataclass(frozen=True)
class DeletionGuard:
    """How much one ingest run may delete.

    Args:
        max_fraction: the largest share of the collection's documents one run may delete (0..1).
        allow_mass_delete: the operator knows: delete what is gone, however much, even under a
            root that yields nothing.
    """

    max_fraction: float = DEFAULT_MAX_DELETE_FRACTION
    allow_mass_delete: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction must be between 0 and 1, got {self.max_fraction}")

    def check_roots(self, roots: Sequence[Path], stored_keys: Iterable[str],
                    has_sources: Callable[[Path], bool]) -> None:
        """Refuse a run over a root that yields nothing while the collection has documents under it.

        Raises:
            MassDeleteError: naming the first such root and how many documents it would wipe.
        """
        if self.allow_mass_delete:
            return
        under = dict.fromkeys(roots, 0)
        for key in stored_keys:
            for root in roots:
                if is_under(key, root):
                    under[root] += 1
        for root, count in under.items():
            if count and not has_sources(root):
                raise MassDeleteError(
                    f"{root} has no documents to ingest, but the collection holds {count} from it: "
                    "is a file system unmounted or a directory moved? Nothing was changed. If the "
                    "documents are really gone, run again with --allow-mass-delete")

    def refusal(self, would_delete: int, documents: int) -> DeletionRefusal | None:
        """None when deleting `would_delete` of `documents` is allowed, else why not."""
        if self.allow_mass_delete or would_delete <= self.max_fraction * documents:
            return None
        return DeletionRefusal(would_delete, documents, self.max_fraction)

