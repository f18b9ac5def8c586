"""Rebuilding a collection with another embedder or chunking beside the live one.

An ingest whose embedder or chunking settings differ from those a collection was built with
cannot update it in place (old and new vectors are not comparable), and must not empty it
while queries run. It writes the next generation instead, as a hidden collection `NAME@G`
(what users see as "version G"), from scratch and one document per transaction like any
ingest, so a killed rebuild resumes where it stopped. Queries keep reading the live
generation; the catalog promotes the new one in a single transaction once it holds every
document the live one has, and the old generation is deleted after that.

While the build runs, permission changes and deletions found by the walk are applied to the
live generation too: a revoked reader must not keep access for as long as a rebuild takes.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rag.types import Chunk, Document
from retrieval.base import CollectionStore
from retrieval.catalog import Catalog, ChunkRecord, CollectionInfo, DocumentState, generation_name
from retrieval.index import CollectionIndex, move_index_file, remove_index_files

log = logging.getLogger(__name__)


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


class CollectionBuild:
    """The next generation of a collection, written beside the live one.

    A `CollectionStore` for ingest: documents are written to the build; its document states
    include the live generation's documents that the build lacks, with a content hash that
    matches nothing, so the ingest pipeline embeds them into the build, or deletes them (from
    both) when their sources are gone. Reads see the build. `finish` promotes it.
    """

    def __init__(self, catalog: Catalog | None, name: str, live: CollectionInfo, build: CollectionInfo,
                 index_dir: Path | None, store_kind: str, open_live: Callable[[], CollectionStore]) -> None:
        self.catalog = catalog
        self.live = live
        self.index_dir = index_dir
        self.store_kind = store_kind
        self._name = name
        self._info = build
        self._build: CollectionStore | None = None  # its vectors are loaded on first use
        self._open_live = open_live
        self._live_index: CollectionStore | None = None  # opened only when a live document changes
        self._live_acl: dict[str, frozenset[str]] = {}
        self.notice = (f"collection {name!r} was built with {describe(live)}; building version "
                       f"{build.generation} with {describe(build)}; queries use version "
                       f"{live.generation} until it completes")

    @property
    def name(self) -> str:
        return self._name

    @property
    def info(self) -> CollectionInfo:
        return self._info

    @property
    def build(self) -> CollectionStore:
        if self._build is None:
            self._build = self._open_build()
        return self._build

    def _open_build(self) -> CollectionStore:
        return CollectionIndex(self.catalog, self._info, self.index_dir, self.store_kind)

    def _live_states(self) -> dict[str, DocumentState]:
        return self.catalog.document_states(self.live.name)

    # -- writes ----------------------------------------------------------------------------

    def replace_document(self, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
                         vectors: np.ndarray) -> None:
        self._mirror_acl(doc.key, acl)
        self.build.replace_document(doc, acl, chunks, vectors)

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        self._mirror_acl(key, acl)
        self.build.set_acl(key, acl)

    def delete_document(self, key: str) -> None:
        if key in self._live_acl:
            self._live().delete_document(key)
            del self._live_acl[key]
        self.build.delete_document(key)

    def save(self) -> None:
        self.build.save()  # also when nothing was written: finish() renames the saved file
        if self._live_index is not None:
            self._live_index.save()

    def finish(self) -> BuildOutcome:
        """Promote the build if it holds every document of the live generation, then drop the old one.

        Call after `save`. A run that stops anywhere in here leaves either the old generation
        live (and the build to resume) or the new one live (and the old one to drop next time).
        """
        build = self._info
        outcome = BuildOutcome(self.name, self.live.generation, build.generation, describe(self.live),
                               describe(build))
        outcome.missing, outcome.missing_examples = self.catalog.missing_documents(self.live.name, build.name)
        if outcome.missing:
            return outcome
        saved_version = self.catalog.version(build.name)
        retired = self.catalog.promote(self.name, build.name)
        index_dir, kind = self.index_dir, self.store_kind
        new_version = self.catalog.version(self.name)
        if not move_index_file(index_dir, kind, (build.name, saved_version), (self.name, new_version)):
            if index_dir is not None:  # readers rebuild from the catalog; the old files are stale
                remove_index_files(index_dir, self.name, kind)
        outcome.switched = True
        outcome.old_documents_deleted = drop_generation(self.catalog, retired, index_dir, kind)
        return outcome

    # -- reads -----------------------------------------------------------------------------

    def document_states(self) -> dict[str, DocumentState]:
        live = self._live_states()
        self._live_acl = {key: state.acl for key, state in live.items()}
        states = {key: dataclasses.replace(state, content_hash="") for key, state in live.items()}
        del live
        states.update(self.build.document_states())
        return states

    def refresh(self) -> bool:
        return self.build.refresh()

    def stats(self) -> dict[str, int]:
        return self.build.stats()

    def search(self, query: np.ndarray, k: int, tokens: Sequence[str],
               exact: bool = False) -> list[tuple[int, float]]:
        return self.build.search(query, k, tokens, exact)

    def keyword_search(self, text: str, k: int, tokens: Sequence[str]) -> list[tuple[int, float]]:
        return self.build.keyword_search(text, k, tokens)

    def chunk_records(self, ids: Sequence[int]) -> dict[int, ChunkRecord]:
        return self.build.chunk_records(ids)

    def dump(self) -> list[dict]:
        return self.build.dump()

    # -- internals -------------------------------------------------------------------------

    def _mirror_acl(self, key: str, acl: frozenset[str]) -> None:
        # The live generation first: if the run dies between the two writes, the next run
        # still sees the build's old ACL differ and repeats both.
        old = self._live_acl.get(key)
        if old is not None and old != acl:
            self._live().set_acl(key, acl)
            self._live_acl[key] = acl

    def _live(self) -> CollectionStore:
        if self._live_index is None:
            self._live_index = self._open_live()
        return self._live_index


def open_for_ingest(catalog: Catalog, name: str, spec: BuildSpec, index_dir: Path | None, store_kind: str,
                    open_live: Callable[[], CollectionIndex]) -> CollectionIndex | CollectionBuild:
    """What an ingest into collection `name` with `spec` writes to.

    The collection itself (created if new) when it was built the same way; otherwise its next
    generation, resumed if a killed run left one built the same way. Generations left over by
    an interrupted switch, or built with settings no longer asked for, are dropped first.

    Args:
        open_live: opens (or returns the already open) index of the live collection.
    """
    live = catalog.find_collection(name)
    hidden = catalog.hidden_generations(name)
    pending = [h for h in hidden if live is not None and h.generation > live.generation]
    resume = next((h for h in pending if spec.matches(h)), None)
    if live is None or spec.matches(live):
        resume = None
    for h in hidden:
        if h is not resume:
            if h in pending:
                log.warning("dropping the unfinished version %d of collection %r (%s): this run builds with %s",
                            h.generation, name, describe(h), describe(spec))
            drop_generation(catalog, h.name, index_dir, store_kind)
    _remove_orphan_files(catalog, name, index_dir)
    if live is None:
        catalog.create_collection(name, spec.embedder, spec.fingerprint, spec.dim, spec.chunking)
        return open_live()
    if spec.matches(live):
        return open_live()
    build = resume or catalog.create_collection(
        generation_name(name, live.generation + 1), spec.embedder, spec.fingerprint, spec.dim, spec.chunking,
        generation=live.generation + 1)
    return CollectionBuild(catalog, name, live, build, index_dir, store_kind, open_live)


def drop_generation(catalog: Catalog, name: str, index_dir: Path | None, store_kind: str) -> int:
    """Delete a hidden generation: documents, chunks, vectors and index files; returns documents deleted."""
    deleted = catalog.drop_collection(name)
    if index_dir is not None:
        remove_index_files(index_dir, name, store_kind)
    return deleted


def _remove_orphan_files(catalog: Catalog, name: str, index_dir: Path | None) -> None:
    """Index files of generations that no longer exist (a run killed between promote and rename)."""
    if index_dir is None or not index_dir.is_dir():
        return
    pattern = re.compile(rf"({re.escape(name)}@\d+)\.v\d+\.\w+(\.tmp)?")
    for path in index_dir.iterdir():
        m = pattern.fullmatch(path.name)
        if m and catalog.find_collection(m.group(1)) is None:
            path.unlink(missing_ok=True)
