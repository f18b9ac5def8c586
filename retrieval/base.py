"""Protocols of the retrieval layer: vector indexes that filter inside the search, collection stores,
rerankers. Their record types are in `retrieval.records`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from rag.types import Chunk, Document, Hit
from retrieval.records import BuildOutcome, ChunkRecord, CollectionInfo, DocumentState, DocumentWrite


class VectorIndex(Protocol):
    """Inner-product search over L2-normalized vectors, restricted to allowed ids.

    The allow-list is applied inside the search (never by filtering a global top-k
    afterwards), so a user with access to few chunks still gets up to k of them.
    """

    dim: int

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors (n, dim) float32 under int64 ids; an existing id is replaced."""
        ...

    def remove(self, ids: np.ndarray) -> None:
        """Remove ids; unknown ids are ignored."""
        ...

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray, exact: bool = False
               ) -> list[tuple[int, float]]:
        """Top-k (id, score) among `allowed` ids, best first; fewer when fewer are allowed.

        Approximate stores search exhaustively when `exact` is set.
        """
        ...

    def count(self) -> int:
        ...


class Reranker(Protocol):
    """Reorders retrieved hits by relevance to the query."""

    def rerank(self, query: str, hits: Sequence[Hit], top_n: int | None = None) -> list[Hit]:
        """New hits with the reranker's score, best first; at most top_n when given."""
        ...


class CollectionStore(Protocol):
    """One collection's documents, chunks, ACLs and vectors, searchable under an ACL filter.

    Backends (`retrieval.stores`): the embedded default is the SQLite catalog + a vector index
    (`retrieval.stores.embedded.collection.EmbeddedCollection`);
    `retrieval.stores.pgvector.collection.PgvectorCollection` keeps all of it in PostgreSQL. A
    collection's next version being built beside it (`retrieval.rebuild.CollectionBuild`) is one
    too. Ingest, the retriever, the jobs and the contract suite only use this protocol.

    `tokens` are a principal's ACL tokens (`permissions.policy.store_filter`): a chunk is
    searchable when its document's ACL names at least one of them. The filter is applied
    inside the search, so a principal who may read few chunks still gets up to k of them;
    an empty token list matches nothing.
    """

    info: CollectionInfo  # name, embedder, fingerprint, dim, chunking
    # Set on a collection's next version being built (a rebuild): what to tell the person whose
    # ingest writes it. None on a plain collection.
    notice: str | None

    @property
    def name(self) -> str: ...

    # -- writes: each one is atomic (a crash leaves the old or the new document, never half)
    def replace_document(self, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
                         vectors: np.ndarray) -> None: ...

    def replace_documents(self, writes: Sequence[DocumentWrite]) -> None:
        """`replace_document` for each, in order (what ingest writes after an embed batch); a store
        may write them together, all or none."""
        ...

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        """Change a document's ACL without touching its chunks or vectors (NotFoundError if absent)."""
        ...

    def delete_document(self, key: str) -> None:
        """Delete a document and its chunks; an unknown key is a no-op."""
        ...

    def flush(self) -> None:
        """Commit the writes a store buffers (pgvector writes a batch of documents per transaction).

        Reads, `save` and `close` commit them too; a no-op where each write commits on its own.
        """
        ...

    def release_thread(self) -> None:
        """The calling thread is done with the store: commit its buffered writes (as `flush`) and close
        what the store opened for it (the embedded catalog's connection of this thread). Ingest's
        writer thread calls it before it ends."""
        ...

    def save(self) -> None:
        """Make writes durable for other readers (Faiss file); a no-op where writes already are."""
        ...

    def finish(self) -> BuildOutcome | None:
        """End an ingest run, after `save`: a rebuild switches to the new version if it is complete.

        Returns what the rebuild did; None for a plain collection (nothing to switch).
        """
        ...

    # -- reads
    def refresh(self) -> bool:
        """Pick up other writers' changes; True when something was reloaded."""
        ...

    def document_states(self) -> dict[str, DocumentState]: ...

    def stats(self) -> dict[str, int]:
        """{"documents": n, "chunks": n}."""
        ...

    def search(self, query: np.ndarray, k: int, tokens: Sequence[str],
               exact: bool = False) -> list[tuple[int, float]]:
        """Dense top-k (chunk id, inner product) among chunks `tokens` may read, best first.

        `exact=True` asks for exhaustive search (the contract suite compares stores with it).
        """
        ...

    def keyword_search(self, text: str, k: int, tokens: Sequence[str]) -> list[tuple[int, float]]:
        """Keyword top-k (chunk id, score: higher is better) among readable chunks, best first."""
        ...

    def chunk_records(self, ids: Sequence[int]) -> dict[int, ChunkRecord]: ...

    def dump(self) -> list[dict]:
        """Canonical id-free rows (key, hash, acl, title, index, text, heading, vector)."""
        ...
