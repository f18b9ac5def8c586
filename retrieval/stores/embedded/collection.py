"""EmbeddedCollection: one collection of the catalog plus its vector index, kept in step.

Index files are named after the catalog version they match (`NAME.v42.faiss`). Opening a
collection loads the file of the current version, or rebuilds it from the vectors in the
catalog when none matches (after a crash, or after another process wrote): the index can
never serve a state the catalog does not have. The index counts its own writes, so a save
that finds the catalog further along (another writer) rebuilds rather than mislabel a file.

Vector writes are queued and applied to the store in bulk before it is next read: Faiss's
ID map scans every stored id on each add or remove call, so one call per document made a
large ingest quadratic (50,000 one-chunk documents: 105 s in the store, now ~1 s). Catalog
writes are batched the same way: each document in a savepoint of one transaction that `flush`
commits (ingest flushes after every embed batch), not a commit per document.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag.errors import StoreError
from rag.private_files import private_mkdir
from rag.types import Chunk, Document
from retrieval.base import VectorIndex
from retrieval.records import ChunkRecord, CollectionInfo, DocumentState, DocumentWrite
from retrieval.stores.embedded.catalog import Catalog
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.row_sets import RowSet, union, unique_sorted

if TYPE_CHECKING:
    from retrieval.vectors.faiss_gpu import GpuPlacement

# Index file suffix per vector store kind ("faiss" keeps the name older data dirs used).
_SUFFIX = {"faiss": "faiss", "faiss-hnsw": "hnsw", "faiss-ivf": "ivf"}
# Queued vector writes applied in one call: bounds the queue (~6 MB of 384-d vectors).
_BULK = 4096
# Cached allow-lists (ids and index rows per ACL token) above this are dropped: at 10M chunks one
# broad token holds up to 80 MB of ids and a 1.25 MB bitmap.
_CACHE_BYTES = 512 << 20

log = logging.getLogger(__name__)


class EmbeddedCollection:
    """Writes go to the catalog first (a batch of documents per transaction), then to the vector index.

    Implements `retrieval.base.CollectionStore` for the embedded default.
    """

    notice: str | None = None  # a plain collection, not a rebuild (see retrieval.base.CollectionStore)

    def __init__(self, catalog: Catalog, info: CollectionInfo, index_dir: Path | None,
                 vector_kind: str = "faiss", exact_below: int | None = None,
                 gpu: GpuPlacement | None = None) -> None:
        """`exact_below` goes to the approximate stores, `gpu` to a "faiss-ivf" one, whether made
        empty or loaded from its file (see `retrieval.vectors.make_vector_index`)."""
        self.catalog = catalog
        self.info = info
        self.index_dir = index_dir
        self.vector_kind = vector_kind
        self.exact_below = exact_below
        self.gpu = gpu
        self._vectors: VectorIndex = self._empty_store()
        self._queued = _QueuedWrites()
        self.loaded_version = -1
        # Ingest (open_for_ingest, shard jobs) writes a batch of documents per catalog transaction,
        # committed by flush(); direct use commits each write, so other threads' connections (the
        # keyword search, a query) see it at once, as before batching existed.
        self.batch_writes = False
        # Allowed chunk ids per ACL token, valid for one catalog version: a user's groups are
        # looked up once per change of the collection, not on every query. An approximate index
        # also gets each token's ids translated to its rows once (`retrieval.vectors.row_sets`).
        self._allowed_cache: dict[str, np.ndarray] = {}
        self._rows_cache: dict[str, RowSet] = {}
        self._union_cache: dict[tuple[str, ...], RowSet] = {}  # a principal's tokens -> their rows
        self._cached_bytes = 0
        self._allowed_version = -1
        self.refresh()

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def vectors(self) -> VectorIndex:
        """The vector index, with every write made so far applied."""
        self._queued.apply(self._vectors)
        return self._vectors

    # -- keeping the store in step with the catalog -------------------------------------

    def refresh(self) -> bool:
        """Reload if another writer changed the collection; True when something was loaded.

        The collection's info is read again too: a rebuilt collection (`retrieval.rebuild`)
        comes back under the same name with another embedder, dimension or chunking.
        """
        info = self.catalog.get_collection(self.name)
        if info.version == self.loaded_version:
            return False
        self.info = info
        path = self._path(info.version)
        store = None
        if path is not None and path.exists():
            try:
                store = load_vector_index(self.vector_kind, path, info.dim, self.exact_below, self.gpu)
                log.debug("loaded %s", path)
            except StoreError as e:  # a damaged cache file: the catalog has everything
                log.warning("%s; rebuilding the index of %r from the catalog", e, self.name)
        if store is None:
            # The version is read before the vectors: if a writer commits in between, the
            # store is newer than its label and the next refresh or save loads it again.
            store = self._empty_store()
            for ids, vectors in self.catalog.iter_vectors(self.name):
                store.add(ids, vectors)
            log.info("rebuilt index of %r from the catalog (%d vectors)", self.name, store.count())
        self._vectors = store
        self._queued = _QueuedWrites()  # committed before they were queued: the reload has them
        self.loaded_version = info.version
        return True

    def save(self) -> None:
        """Persist the store under the current catalog version and drop older files.

        Also purges removed text from the catalog's files (`Catalog.purge_removed_text`): a
        batch of writes ends here, so the keyword tables are rewritten once per batch.
        """
        self.catalog.commit()
        self.catalog.purge_removed_text()
        if self.index_dir is None or self._path(0) is None:
            return
        # Our own writes advanced loaded_version one by one; anything more is another writer's,
        # which the store lacks: reload (from the catalog) rather than mislabel the file.
        while self.catalog.version(self.name) != self.loaded_version:
            self.refresh()
        private_mkdir(self.index_dir)
        path = self._path(self.loaded_version)
        assert path is not None
        self.vectors.save(path)
        remove_index_files(self.index_dir, self.name, self.vector_kind, keep=path)

    # -- writes ----------------------------------------------------------------------------

    def finish(self) -> None:
        """Nothing to switch: this is the live collection."""
        return None

    def flush(self) -> None:
        """Commit the documents written since the last commit (one catalog transaction)."""
        self.catalog.commit()

    def release_thread(self) -> None:
        """Commit this thread's writes and close its catalog connection (ingest's writer thread ends)."""
        self.catalog.release_thread()

    def replace_document(self, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
                         vectors: np.ndarray) -> None:
        """Write a document whole. With `batch_writes` (ingest) it is a savepoint committed with its
        batch: at `flush`, `save`, the next ACL change or delete, or at `catalog.BATCH_DOCUMENTS`
        documents; otherwise its own transaction, committed here."""
        self.replace_documents([DocumentWrite(doc, acl, chunks, vectors)])

    def replace_documents(self, writes: Sequence[DocumentWrite]) -> None:
        """Write several documents, all or none, in a few catalog statements (`Catalog.replace_documents`)."""
        results = self.catalog.replace_documents(self.name, writes, batched=self.batch_writes)
        for (removed, added), w in zip(results, writes, strict=True):
            self._queued.remove(removed)
            self._queued.add(added, w.vectors)
        if self._queued.size >= _BULK:
            self._queued.apply(self._vectors)
        self.loaded_version += len(writes)  # the catalog bumps the version once per document

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        # ACLs live only in the catalog: the filter is read from it at query time.
        self.catalog.set_acl(self.name, key, acl)
        self.loaded_version += 1

    def delete_document(self, key: str) -> None:
        removed = self.catalog.delete_document(self.name, key)
        self._queued.remove(removed)
        if self._queued.size >= _BULK:
            self._queued.apply(self._vectors)
        self.loaded_version += 1

    # -- reads -----------------------------------------------------------------------------

    def document_states(self) -> dict[str, DocumentState]:
        return self.catalog.document_states(self.name)

    def stats(self) -> dict[str, int]:
        return self.catalog.collection_stats(self.name)

    def search(self, query: np.ndarray, k: int, tokens: Sequence[str],
               exact: bool = False) -> list[tuple[int, float]]:
        # The allow-list comes from the catalog's ACL table and goes into the vector search
        # as an ID selector: chunks outside it are never scored.
        vectors = self.vectors
        if hasattr(vectors, "search_rows"):  # an approximate index: rows per token and principal, cached
            return vectors.search_rows(query, k, self._principal_rows(tuple(sorted(set(tokens))), vectors),
                                       exact=exact)
        return vectors.search(query, k, self.allowed_ids(tokens), exact=exact)

    def allowed_ids(self, tokens: Sequence[str]) -> np.ndarray:
        """Sorted chunk ids whose document ACL names one of `tokens` (in the loaded version)."""
        parts = [self._ids(token) for token in sorted(set(tokens))]
        if not parts:
            return np.empty(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else unique_sorted(np.concatenate(parts))

    def _ids(self, token: str) -> np.ndarray:
        self._check_cache()
        ids = self._allowed_cache.get(token)
        if ids is None:
            ids = self.catalog.allowed_chunk_ids(self.name, [token])
            self._remember(self._allowed_cache, token, ids, ids.nbytes)
        return ids

    def _principal_rows(self, tokens: tuple[str, ...], vectors) -> list[RowSet]:
        """The rows of `tokens` as one set: the union is cached per token tuple, since the same
        principals ask again (50 groups of 10M rows: 5.6 ms to OR their bitmaps)."""
        parts = [self._rows(token, vectors) for token in tokens]
        if len(parts) < 2:
            return parts
        rows = self._union_cache.get(tokens)
        if rows is None or rows.generation != vectors.generation:
            rows = union(parts, parts[0].generation, parts[0].n)
            self._remember(self._union_cache, tokens, rows, rows.nbytes)
        return [rows]

    def _rows(self, token: str, vectors) -> RowSet:
        """The token's rows in `vectors`, remade when the index changed since they were cached."""
        ids = self._ids(token)
        rows = self._rows_cache.get(token)
        if rows is None or rows.generation != vectors.generation:
            rows = vectors.rows_for(ids)
            self._remember(self._rows_cache, token, rows, rows.nbytes)
        return rows

    def _check_cache(self) -> None:
        if self._allowed_version != self.loaded_version:
            self._clear_cache()
            self._allowed_version = self.loaded_version

    def _clear_cache(self) -> None:
        self._allowed_cache.clear()
        self._rows_cache.clear()
        self._union_cache.clear()
        self._cached_bytes = 0

    def _remember(self, cache: dict, key, value, nbytes: int) -> None:
        # Many distinct users, or a few broad tokens over a very large collection: keep memory
        # bounded by starting over (the caller holds what it is using; the next queries refill).
        entries = len(self._allowed_cache) + len(self._rows_cache) + len(self._union_cache)
        if entries >= 8192 or self._cached_bytes + nbytes > _CACHE_BYTES:
            self._clear_cache()
        cache[key] = value
        self._cached_bytes += nbytes

    def keyword_search(self, text: str, k: int, tokens: Sequence[str]) -> list[tuple[int, float]]:
        return self.catalog.keyword_search(self.name, text, k, tokens)

    def chunk_records(self, ids: Sequence[int]) -> dict[int, ChunkRecord]:
        return self.catalog.chunk_records(ids, self.name)

    def dump(self) -> list[dict]:
        return self.catalog.dump(self.name)

    # -- internals -------------------------------------------------------------------------

    def _empty_store(self) -> VectorIndex:
        return make_vector_index(self.vector_kind, self.info.dim, self.exact_below, self.gpu)

    def _path(self, version: int) -> Path | None:
        if self.index_dir is None or self.vector_kind not in _SUFFIX:
            return None
        return self.index_dir / f"{self.name}.v{version}.{_SUFFIX[self.vector_kind]}"


class _QueuedWrites:
    """Vector removals and additions not yet applied to a store, in the order that matters.

    Added chunk ids are new (the catalog never reuses one), so applying every removal, then
    every addition, is the same as applying them one by one; removing an id still queued
    for addition just drops it from the queue.
    """

    def __init__(self) -> None:
        self._removed: list[int] = []
        self._added: dict[int, np.ndarray] = {}  # id -> vector (dim,)

    @property
    def size(self) -> int:
        return len(self._removed) + len(self._added)

    def remove(self, ids: Sequence[int]) -> None:
        for i in ids:
            if self._added.pop(int(i), None) is None:
                self._removed.append(int(i))

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        for i, vector in zip(ids, vectors, strict=True):
            self._added[int(i)] = np.array(vector, dtype=np.float32)  # the caller may reuse its array

    def apply(self, store: VectorIndex) -> None:
        if self._removed:
            store.remove(np.asarray(self._removed, dtype=np.int64))
            self._removed = []
        if self._added:
            ids = np.fromiter(self._added, dtype=np.int64, count=len(self._added))
            store.add(ids, np.stack(list(self._added.values())).astype(np.float32, copy=False))
            self._added = {}


def remove_index_files(index_dir: Path, name: str, vector_kind: str, keep: Path | None = None) -> None:
    """Delete the index files of collection `name` (and leftovers of interrupted saves), but `keep`.

    Matched exactly, so collection "lab" never touches the files of "lab.v2".
    """
    suffix = _SUFFIX.get(vector_kind)
    if suffix is None or not index_dir.is_dir():
        return
    pattern = re.compile(rf"{re.escape(name)}\.v\d+\.{suffix}(\.tmp)?")
    for path in index_dir.iterdir():
        if path != keep and pattern.fullmatch(path.name):
            path.unlink(missing_ok=True)


def move_index_file(index_dir: Path | None, vector_kind: str, source: tuple[str, int],
                    target: tuple[str, int]) -> bool:
    """Rename the index file of (collection, version) `source` to that of `target`.

    Used when a rebuilt collection takes the live name: its file is exactly the new state,
    so readers load it instead of rebuilding from the catalog. False when there is no file.
    """
    suffix = _SUFFIX.get(vector_kind)
    if index_dir is None or suffix is None:
        return False
    path = index_dir / f"{source[0]}.v{source[1]}.{suffix}"
    if not path.exists():
        return False
    dest = index_dir / f"{target[0]}.v{target[1]}.{suffix}"
    os.replace(path, dest)
    remove_index_files(index_dir, target[0], vector_kind, keep=dest)
    return True
