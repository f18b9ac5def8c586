"""Versioned rebuilds of an embedded collection: the next generation beside the live one in the catalog.

How the embedded backend does what `retrieval.rebuild` describes: the build is the hidden
catalog collection `NAME@G` with its own index file; the catalog promotes it in one
transaction and its saved index file is renamed to the live name's, so readers reload.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from retrieval.base import CollectionStore
from retrieval.rebuild import CollectionBuild
from retrieval.records import BuildOutcome, BuildSpec, CollectionInfo, DocumentState, describe, generation_name
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection, move_index_file, remove_index_files

if TYPE_CHECKING:
    from retrieval.vectors.faiss_gpu import GpuPlacement

log = logging.getLogger(__name__)


class EmbeddedBuild(CollectionBuild):
    """The next generation of an embedded collection (see `retrieval.rebuild.CollectionBuild`)."""

    def __init__(self, catalog: Catalog, name: str, live: CollectionInfo, build: CollectionInfo,
                 index_dir: Path | None, vector_kind: str, open_live: Callable[[], CollectionStore],
                 gpu: GpuPlacement | None = None) -> None:
        super().__init__(name, live, build, open_live)
        self.catalog = catalog
        self.index_dir = index_dir
        self.vector_kind = vector_kind
        self.gpu = gpu  # a rebuild builds its "faiss-ivf" index where the live one is searched

    def _open_build(self) -> CollectionStore:
        build = EmbeddedCollection(self.catalog, self._info, self.index_dir, self.vector_kind, gpu=self.gpu)
        build.batch_writes = True  # only ingest writes a build
        return build

    def _live_states(self) -> dict[str, DocumentState]:
        return self.catalog.document_states(self.live.name)

    def finish(self) -> BuildOutcome:
        build = self._info
        outcome = BuildOutcome(self.name, self.live.generation, build.generation, describe(self.live),
                               describe(build))
        outcome.missing, outcome.missing_examples = self.catalog.missing_documents(self.live.name, build.name)
        if outcome.missing:
            return outcome
        saved_version = self.catalog.version(build.name)
        retired = self.catalog.promote(self.name, build.name)
        index_dir, kind = self.index_dir, self.vector_kind
        new_version = self.catalog.version(self.name)
        if not move_index_file(index_dir, kind, (build.name, saved_version), (self.name, new_version)):
            if index_dir is not None:  # readers rebuild from the catalog; the old files are stale
                remove_index_files(index_dir, self.name, kind)
        outcome.switched = True
        outcome.old_documents_deleted = drop_generation(self.catalog, retired, index_dir, kind)
        return outcome


def open_for_ingest(catalog: Catalog, name: str, spec: BuildSpec, index_dir: Path | None, vector_kind: str,
                    open_live: Callable[[], EmbeddedCollection], gpu: GpuPlacement | None = None
                    ) -> EmbeddedCollection | EmbeddedBuild:
    """What an ingest into collection `name` with `spec` writes to.

    The collection itself (created if new) when it was built the same way; otherwise its next
    generation, resumed if a killed run left one built the same way. Generations left over by
    an interrupted switch, or built with settings no longer asked for, are dropped first.

    Args:
        open_live: opens (or returns the already open) index of the live collection.
        gpu: where a next generation's "faiss-ivf" index builds and searches (None: the CPU).
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
            drop_generation(catalog, h.name, index_dir, vector_kind)
    _remove_orphan_files(catalog, name, index_dir)
    if live is None:
        catalog.create_collection(name, spec.embedder, spec.fingerprint, spec.dim, spec.chunking)
        return _batched(open_live())
    if spec.matches(live):
        return _batched(open_live())
    build = resume or catalog.create_collection(
        generation_name(name, live.generation + 1), spec.embedder, spec.fingerprint, spec.dim, spec.chunking,
        generation=live.generation + 1)
    return EmbeddedBuild(catalog, name, live, build, index_dir, vector_kind, open_live, gpu)


def _batched(collection: EmbeddedCollection) -> EmbeddedCollection:
    """The collection with ingest's batched catalog writes on (see EmbeddedCollection.batch_writes)."""
    collection.batch_writes = True
    return collection


def drop_generation(catalog: Catalog, name: str, index_dir: Path | None, vector_kind: str) -> int:
    """Delete a hidden generation: documents, chunks, vectors and index files; returns documents deleted."""
    deleted = catalog.drop_collection(name)
    if index_dir is not None:
        remove_index_files(index_dir, name, vector_kind)
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
