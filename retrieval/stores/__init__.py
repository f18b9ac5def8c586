"""Vector store implementations, by name."""

from __future__ import annotations

from rag.errors import ConfigError
from retrieval.base import VectorStore

STORE_KINDS = ("memory", "faiss")


def make_store(kind: str, dim: int) -> VectorStore:
    """Create an empty store of a registered kind."""
    if kind == "memory":
        from retrieval.stores.memory import MemoryStore

        return MemoryStore(dim)
    if kind == "faiss":
        from retrieval.stores.faiss import FaissStore

        return FaissStore(dim)
    raise ConfigError(f"unknown store {kind!r}; choose one of: {', '.join(STORE_KINDS)}")
