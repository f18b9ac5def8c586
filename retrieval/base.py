"""Protocols of the retrieval layer: vector stores that filter inside the search, rerankers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from rag.types import Hit


class VectorStore(Protocol):
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

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray) -> list[tuple[int, float]]:
        """Top-k (id, score) among `allowed` ids, best first; fewer when fewer are allowed."""
        ...

    def count(self) -> int:
        ...


class Reranker(Protocol):
    """Reorders retrieved hits by relevance to the query."""

    def rerank(self, query: str, hits: Sequence[Hit], top_n: int | None = None) -> list[Hit]:
        """New hits with the reranker's score, best first; at most top_n when given."""
        ...
