"""The record types every collection store speaks in, whatever its backend.

`retrieval.base.CollectionStore` is the protocol; these are what it takes and returns: what a
collection was built with, the stored state incremental ingest compares against, a stored chunk
joined with its document, how a rebuild is specified and what it did, and what a run did to a
collection's documents. Backends live in `retrieval.stores`; none of them owns these types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

    from rag.types import Chunk, Document

# Hidden generations of a collection are named NAME@G; '@' is not allowed in collection names
# (`rag.settings.check_collection_name`), so they can never clash with a user's collection.
GENERATION_SEP = "@"

def generation_name(name: str, generation: int) -> str:
    """The catalog name of a hidden generation of collection `name`."""
    return f"{name}{GENERATION_SEP}{generation}"


class DocumentWrite(NamedTuple):
    """One document as `CollectionStore.replace_documents` takes it: its chunks and their vectors (n, dim)."""

    doc: Document
    acl: frozenset[str]
    chunks: Sequence[Chunk]
    vectors: np.ndarray


@dataclass(frozen=True)
class CollectionInfo:
    """What a collection was built with; a query must use the same embedder."""

    name: str
    embedder: str
    fingerprint: str
    dim: int
    chunking: dict
    version: int  # bumped by every write; names the index file that matches
    generation: int = 1  # the collection's build: a new embedder or chunking makes the next one


@dataclass(frozen=True, slots=True)
class DocumentState:
    """What incremental ingest compares against: the stored hash and ACL."""

    id: int
    key: str
    content_hash: str
    acl: frozenset[str]
    num_chunks: int


@dataclass(frozen=True)
class ChunkRecord:
    """A stored chunk joined with its document (what a hit is built from)."""

    id: int
    document_key: str
    source: str
    title: str | None
    index: int
    text: str
    heading: str | None
    acl: frozenset[str]


@dataclass(frozen=True)
class BuildSpec:
    """What an ingest would build a collection with: embedder and chunking settings."""

    embedder: str
    fingerprint: str
    dim: int
    chunking: dict

    def matches(self, info: CollectionInfo) -> bool:
        return (self.fingerprint, self.dim, self.chunking) == (info.fingerprint, info.dim, info.chunking)


@dataclass
class BuildOutcome:
    """What a rebuild run did: whether the new generation took over, and if not, why."""

    collection: str
    live_generation: int  # the generation queries used when the run started
    generation: int  # the one being built
    built_with: str
    building_with: str
    switched: bool = False
    missing: int = 0  # documents of the live generation the new one lacks (so no switch)
    missing_examples: list[str] = field(default_factory=list)
    old_documents_deleted: int = 0

    def summary(self) -> str:
        """One or two lines for a person."""
        if self.switched:
            return (f"collection {self.collection!r}: version {self.generation} ({self.building_with}) is "
                    f"complete and now answers queries; version {self.live_generation} was deleted "
                    f"({self.old_documents_deleted} documents)")
        examples = ", ".join(self.missing_examples)
        return (f"collection {self.collection!r}: version {self.generation} is not complete: {self.missing} "
                f"document(s) of version {self.live_generation} are not in it yet (e.g. {examples}); they "
                "failed in this run or lie outside the paths ingested. Fix or remove them, or ingest their "
                f"paths with the same settings, and it switches; queries use version {self.live_generation} "
                "until then")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def describe(info: CollectionInfo | BuildSpec) -> str:
    """How a collection is (or would be) built, in words."""
    chunking = info.chunking
    if "max_tokens" in chunking:
        chunks = f"chunks of {chunking['max_tokens']} tokens ({chunking.get('overlap_tokens', 0)} overlap)"
    else:
        chunks = f"chunking {chunking}"
    return f"embedder {info.embedder} ({info.dim} dims), {chunks}"


@dataclass
class DocumentCounts:
    """What a run did to a collection's documents (an ingest, a merge, seeding a shard)."""

    added: int = 0
    updated: int = 0
    unchanged: int = 0
    acl_updated: int = 0
    deleted: int = 0
    chunks_written: int = 0

    @property
    def changes(self) -> int:
        return self.added + self.updated + self.acl_updated + self.deleted
