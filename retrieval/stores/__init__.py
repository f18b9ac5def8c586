"""Vector store implementations, by name."""

from __future__ import annotations

from pathlib import Path

from rag.errors import ConfigError
from retrieval.base import VectorStore

# Vector stores that sit beside the SQLite catalog (the embedded default). "faiss" is exact
# (flat); the approximate ones keep the ACL filter inside the search too.
STORE_KINDS = ("faiss", "faiss-hnsw", "faiss-ivf", "memory")


def make_store(kind: str, dim: int) -> VectorStore:
    """Create an empty store of a registered kind."""
    if kind == "memory":
        from retrieval.stores.memory import MemoryStore

        return MemoryStore(dim)
    if kind == "faiss":
        from retrieval.stores.faiss import FaissStore

        return FaissStore(dim)
    if kind == "faiss-hnsw":
        from retrieval.stores.faiss_ann import HnswStore

        return HnswStore(dim)
    if kind == "faiss-ivf":
        from retrieval.stores.faiss_ann import IvfStore

        return IvfStore(dim)
    raise ConfigError(f"unknown vector store {kind!r}; choose one of: {', '.join(STORE_KINDS)}")


def load_store(kind: str, path: Path, dim: int) -> VectorStore:
    """Load a store saved by `save` (only the Faiss kinds persist)."""
    from retrieval.stores.faiss import FaissStore
    from retrieval.stores.faiss_ann import HnswStore, IvfStore

    cls = {"faiss": FaissStore, "faiss-hnsw": HnswStore, "faiss-ivf": IvfStore}[kind]
    return cls.load(path, dim)
