"""Collection stores: where a collection's documents, chunks, ACLs and vectors live.

One package per backend, each a `retrieval.base.CollectionStore` with its versioned rebuild:

- `embedded`: the SQLite catalog (source of truth, keyword index) + a vector index file
  (`retrieval.vectors`: flat Faiss, HNSW, IVF or in-memory), all under the data directory;
- `pgvector`: everything in PostgreSQL, for many writers and shared servers.

`CollectionStores` is the one place that picks a backend from the `store` setting; the
service, ingest and the jobs above it only ever hold a `CollectionStore`. Backends are
imported on first use, so the embedded default never loads the PostgreSQL driver.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from retrieval.vectors import FAISS_GPU_MODES, VECTOR_INDEX_KINDS

if TYPE_CHECKING:
    from retrieval.base import CollectionStore
    from retrieval.records import BuildSpec
    from retrieval.stores.embedded.catalog import Catalog
    from retrieval.vectors.faiss_gpu import GpuPlacement

PGVECTOR = "pgvector"
BACKENDS = (*VECTOR_INDEX_KINDS, PGVECTOR)  # the values of the `store` setting


class CollectionStores:
    """Opens the collections of one data directory's backend, and keeps the live ones open.

    Args:
        kind: the `store` setting: a vector index kind of the embedded backend, or "pgvector".
        catalog: the embedded backend's catalog (called only when that backend is used).
        index_dir: where the embedded backend keeps its vector index files (None: in memory).
        dsn: the PostgreSQL URL (called only when pgvector is used: it may start nothing, or fail
            with a message saying how to configure one).
        faiss_gpu: the `faiss_gpu` setting ("auto", "off", "on"): whether this set's "faiss-ivf"
            indexes, live and rebuilt, build and search on a GPU; or a `GpuPlacement` to use as is
            (a chosen device; tests pass a CPU stand-in). Each set holds its own, so two in one
            process (two `Rag` objects in a notebook) never change each other's.
        pg_tuning: how the pgvector collections build their indexes (`index_memory_mb`, `hnsw_m`,
            `hnsw_ef_construction`: the `pg_index_memory_mb`, `pg_hnsw_m` and
            `pg_hnsw_ef_construction` settings), for the ones ingest writes to and the live ones
            alike (an ingest into an open collection writes through the live one).

    Raises:
        ValueError: an unknown `faiss_gpu` mode.
        ConfigError: `faiss_gpu` "on" where Faiss sees no GPU (the message says what to install).
    """

    def __init__(self, kind: str, catalog: Callable[[], Catalog], index_dir: Path | None,
                 dsn: Callable[[], str], faiss_gpu: str | GpuPlacement = "off",
                 pg_tuning: dict[str, int] | None = None) -> None:
        self.kind = kind
        self._pg_tuning = dict(pg_tuning or {})
        self._catalog = catalog
        self._index_dir = index_dir
        self._dsn = dsn
        self._live: dict[str, CollectionStore] = {}
        self._lock = threading.Lock()
        self._faiss_gpu = faiss_gpu
        self._placement: GpuPlacement | None = None
        self._placement_resolved = not isinstance(faiss_gpu, str)
        if isinstance(faiss_gpu, str):
            if faiss_gpu not in FAISS_GPU_MODES:
                raise ValueError(f"faiss_gpu must be one of {', '.join(FAISS_GPU_MODES)}, got {faiss_gpu!r}")
            if faiss_gpu == "on":  # fail at startup, not at the first large build (loads Faiss only here)
                from retrieval.vectors.faiss_gpu import check_gpu

                check_gpu(faiss_gpu)
        else:
            self._placement = faiss_gpu

    @property
    def is_pgvector(self) -> bool:
        return self.kind == PGVECTOR

    def open(self, name: str) -> CollectionStore:
        """The live collection `name`, the one queries read (NotFoundError if it does not exist)."""
        with self._lock:
            return self._open_live(name)

    def for_ingest(self, name: str, spec: BuildSpec) -> CollectionStore:
        """What an ingest with `spec` writes to: the collection (created if new) when it was built
        the same way, else its next version, built beside the live one and switched to by
        `finish()` once complete (`retrieval.rebuild`)."""
        with self._lock:
            if self.is_pgvector:
                from retrieval.stores.pgvector.collection import PgvectorCollection
                from retrieval.stores.pgvector.rebuild import open_for_ingest

                target = open_for_ingest(self._dsn(), name, spec, **self._pg_tuning)
                if isinstance(target, PgvectorCollection):
                    if name in self._live:  # keep the open one (its connection); same generation
                        target.close()
                        self._live[name].refresh()
                        return self._live[name]
                    self._live[name] = target
                return target
            from retrieval.stores.embedded.rebuild import open_for_ingest

            return open_for_ingest(self._catalog(), name, spec, self._index_dir, self.kind,
                                   lambda: self._open_live(name), self._gpu())

    def unavailable(self) -> str | None:
        """Why a query could not reach the store now, or None: pgvector asks its server (a connection
        of its own, a few seconds at most); the embedded store is files, always there.

        Raises:
            ConfigError: pgvector with no server configured.
        """
        if not self.is_pgvector:
            return None
        from retrieval.stores.pgvector.session import ping

        return ping(self._dsn())

    def names(self) -> list[str]:
        """The live collections, sorted."""
        if self.is_pgvector:
            from retrieval.stores.pgvector.schema import list_collections

            return sorted(list_collections(self._dsn()))
        return self._catalog().collection_names()

    def close(self) -> None:
        with self._lock:
            for store in self._live.values():
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            self._live.clear()

    def _open_live(self, name: str) -> CollectionStore:
        if name not in self._live:
            if self.is_pgvector:
                from retrieval.stores.pgvector.collection import open_collection

                self._live[name] = open_collection(self._dsn(), name, **self._pg_tuning)
            else:
                from retrieval.stores.embedded.collection import EmbeddedCollection

                catalog = self._catalog()
                self._live[name] = EmbeddedCollection(catalog, catalog.get_collection(name), self._index_dir,
                                                      self.kind, gpu=self._gpu())
        return self._live[name]

    def _gpu(self) -> GpuPlacement | None:
        """Where this set's "faiss-ivf" indexes build and search (None: the CPU); under the lock.

        Resolved at the first "faiss-ivf" collection opened, so a set of another kind never loads
        Faiss' GPU side, and all of this set's collections share one `FaissGpu` (its GPU memory).
        """
        if self.kind != "faiss-ivf":
            return None
        if not self._placement_resolved:
            from retrieval.vectors.faiss_gpu import resolve_placement

            assert isinstance(self._faiss_gpu, str)
            self._placement = resolve_placement(self._faiss_gpu)
            self._placement_resolved = True
        return self._placement
