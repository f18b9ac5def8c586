"""Flat Faiss index: exact inner-product search with the ACL allow-list as an ID selector."""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np

from rag.errors import StoreError
from rag.private_files import create_private_file
from retrieval.vectors.memory import _check


class FlatIndex:
    """IndexIDMap2 over a flat inner-product index (exact, cosine on normalized vectors).

    The allow-list becomes an `IDSelectorBatch` passed in `SearchParameters`, so Faiss
    only ever scores allowed ids: a chunk the principal may not read never leaves the index.
    """

    kind = "flat"

    def __init__(self, dim: int, index: faiss.Index | None = None) -> None:
        self.dim = dim
        self.index = index if index is not None else faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        if self.index.d != dim:
            raise StoreError(f"index has {self.index.d} dims, expected {dim}")

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = _check(vectors, self.dim)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        self.remove(ids)  # replace semantics, as in the protocol
        self.index.add_with_ids(np.ascontiguousarray(vectors), ids)

    def remove(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids):
            self.index.remove_ids(faiss.IDSelectorBatch(ids))

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray, exact: bool = False
               ) -> list[tuple[int, float]]:
        query = _check(query.reshape(1, -1), self.dim)
        allowed = np.ascontiguousarray(allowed, dtype=np.int64)
        if len(allowed) == 0 or k <= 0 or self.index.ntotal == 0:
            return []  # an empty allow-list must never mean "no filter"
        selector = faiss.IDSelectorBatch(allowed)
        params = faiss.SearchParameters(sel=selector)
        k_eff = min(k, len(allowed), self.index.ntotal)
        scores, ids = self.index.search(np.ascontiguousarray(query), k_eff, params=params)
        hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i != -1]
        # Faiss orders equal scores arbitrarily; sort like the reference store.
        hits.sort(key=lambda h: (-h[1], h[0]))
        return hits

    def count(self) -> int:
        return int(self.index.ntotal)

    def save(self, path: Path) -> None:
        """Write atomically: a reader never sees a half-written index file."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        create_private_file(tmp)  # faiss would create it with the umask's mode; it keeps this one
        faiss.write_index(self.index, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, dim: int) -> FlatIndex:
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as e:
            raise StoreError(f"cannot read Faiss index {path}: {e}") from e
        return cls(dim, index)
