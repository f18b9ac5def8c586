"""Rebuilding a collection with another embedder or chunking beside the live one.

An ingest whose embedder or chunking settings differ from those a collection was built with
cannot update it in place (old and new vectors are not comparable), and must not empty it
while queries run. It writes the next generation instead, as a hidden collection `NAME@G`
(what users see as "version G"), from scratch and one document per transaction like any
ingest, so a killed rebuild resumes where it stopped. Queries keep reading the live
generation; the backend promotes the new one in a single transaction once it holds every
document the live one has, and the old generation is deleted after that.

While the build runs, permission changes and deletions found by the walk are applied to the
live generation too: a revoked reader must not keep access for as long as a rebuild takes.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from rag.types import Chunk, Document
from retrieval.base import CollectionStore
from retrieval.records import BuildOutcome, ChunkRecord, CollectionInfo, DocumentState, DocumentWrite, describe

log = logging.getLogger(__name__)


class CollectionBuild(ABC):
    """The next generation of a collection, written beside the live one.

    A `CollectionStore` for ingest: documents are written to the build; its document states
    include the live generation's documents that the build lacks, with a content hash that
    matches nothing, so the ingest pipeline embeds them into the build, or deletes them (from
    both) when their sources are gone. Reads see the build. `finish` promotes it. Each backend
    says how a build is opened, how the live states are read and how the switch is made
    (`retrieval.stores.embedded.rebuild`, `retrieval.stores.pgvector.rebuild`).
    """

    def __init__(self, name: str, live: CollectionInfo, build: CollectionInfo,
                 open_live: Callable[[], CollectionStore]) -> None:
        self.live = live
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

    @abstractmethod
    def _open_build(self) -> CollectionStore:
        """The store of the generation being built."""

    @abstractmethod
    def _live_states(self) -> dict[str, DocumentState]:
        """The document states of the live generation."""

    @abstractmethod
    def finish(self) -> BuildOutcome:
        """Promote the build if it holds every document of the live generation, then drop the old one.

        Call after `save`. A run that stops anywhere in here leaves either the old generation
        live (and the build to resume) or the new one live (and the old one to drop next time).
        """

    # -- writes ----------------------------------------------------------------------------

    def replace_document(self, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
                         vectors: np.ndarray) -> None:
        self._mirror_acl(doc.key, acl)
        self.build.replace_document(doc, acl, chunks, vectors)

    def replace_documents(self, writes: Sequence[DocumentWrite]) -> None:
        for w in writes:
            self._mirror_acl(w.doc.key, w.acl)
        self.build.replace_documents(writes)

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        self._mirror_acl(key, acl)
        self.build.set_acl(key, acl)

    def delete_document(self, key: str) -> None:
        if key in self._live_acl:
            self._live().delete_document(key)
            del self._live_acl[key]
        self.build.delete_document(key)

    def flush(self) -> None:
        self.build.flush()
        if self._live_index is not None:
            self._live_index.flush()

    def release_thread(self) -> None:
        try:
            if self._build is not None:
                self._build.release_thread()
        finally:
            if self._live_index is not None:
                self._live_index.release_thread()

    def save(self) -> None:
        self.build.save()  # also when nothing was written: finish() renames the saved file
        if self._live_index is not None:
            self._live_index.save()

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


