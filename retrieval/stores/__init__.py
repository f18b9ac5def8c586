"""Vector store implementations, by name."""

from __future__ import annotations

from pathlib import Path

from rag.errors import ConfigError
from retrieval.base import VectorStore

# Vector stores that sit beside the SQLite catalog (the embedded default). "faiss" is exact
# (flat); the approximate ones keep the ACL filter inside the search too.
STORE_KINDS = ("faiss", "faiss-hnsw", "faiss-ivf", "memory")


def make_store(kind: str, dim: int, exact_below: int | None = None) -> VectorStore:
    """Create an empty store of a registered kind.

    Args:
        kind: one of STORE_KINDS.
        dim: vector dimension.
        exact_below: for the approximate kinds, allow-lists of at most this many rows are
            searched exactly (0: always search the graph / lists); None keeps the store's
            default. The exact kinds ignore it.

    Raises:
        ConfigError: for an unknown kind.
    """
    if kind == "memory":
        from retrieval.stores.memory import MemoryStore

        return MemoryStore(dim)
    if kind == "faiss":
        from retrieval.stores.faiss import FaissStore

        return FaissStore(dim)
    if kind in ("faiss-hnsw", "faiss-ivf"):
        from retrieval.stores.faiss_ann import HnswStore, IvfStore

        cls = HnswStore if kind == "faiss-hnsw" else IvfStore
        return cls(dim) if exact_below is None else cls(dim, exact_below=exact_below)
    raise ConfigError(f"unknown vector store {kind!r}; choose one of: {', '.join(STORE_KINDS)}")


def load_store(kind: str, path: Path, dim: int, exact_below: int | None = None) -> VectorStore:
    """Load a store saved by `save` (only the Faiss kinds persist); `exact_below` as in make_store."""
    from retrieval.stores.faiss import FaissStore
    from retrieval.stores.faiss_ann import HnswStore, IvfStore

    if kind == "faiss":
        return FaissStore.load(path, dim)
    cls = {"faiss-hnsw": HnswStore, "faiss-ivf": IvfStore}[kind]
    return cls.load(path, dim) if exact_below is None else cls.load(path, dim, exact_below)
