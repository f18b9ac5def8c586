"""The reference vector index: exact inner-product search in numpy. The others must agree with it."""

from __future__ import annotations

import numpy as np

from rag.errors import StoreError


class MemoryIndex:
    """Exact search over an in-memory matrix; ties broken by smaller id."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._vectors: dict[int, np.ndarray] = {}

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = _check(vectors, self.dim)
        for i, v in zip(np.asarray(ids, dtype=np.int64), vectors, strict=True):
            self._vectors[int(i)] = v.copy()

    def remove(self, ids: np.ndarray) -> None:
        for i in np.asarray(ids, dtype=np.int64):
            self._vectors.pop(int(i), None)

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray, exact: bool = False
               ) -> list[tuple[int, float]]:
        query = _check(query.reshape(1, -1), self.dim)[0]
        # A repeated allowed id is one candidate (it must not fill two of the k places).
        ids = sorted({int(i) for i in np.asarray(allowed, dtype=np.int64)} & self._vectors.keys())
        if not ids or k <= 0:
            return []
        mat = np.stack([self._vectors[i] for i in ids])
        scores = mat @ query
        order = sorted(range(len(ids)), key=lambda j: (-float(scores[j]), ids[j]))[:k]
        return [(ids[j], float(scores[j])) for j in order]

    def count(self) -> int:
        return len(self._vectors)


def _check(vectors: np.ndarray, dim: int) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise StoreError(f"expected vectors of shape (n, {dim}), got {vectors.shape}")
    return vectors
