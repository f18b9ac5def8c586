"""Permission-aware retrieval: embed the question, search only allowed chunks, rerank."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Hit
from retrieval.index import CollectionIndex

if TYPE_CHECKING:
    from retrieval.base import Reranker


@dataclass
class RetrievalResult:
    hits: list[Hit]
    timings: dict[str, float] = field(default_factory=dict)
    num_allowed: int = 0


class Retriever:
    """embed → search(filter = principal's ACL, inside the index) → post-check → rerank."""

    def __init__(self, index: CollectionIndex, embed_query: Callable[[str], np.ndarray],
                 reranker: Reranker | None = None) -> None:
        self.index = index
        self.embed_query = embed_query
        self.reranker = reranker

    def retrieve(self, question: str, principal: Principal, k: int = 5,
                 candidates: int = 30, rerank: bool = True) -> RetrievalResult:
        """Top-k hits the principal may read, best first.

        Args:
            question: the user's question (non-empty).
            principal: who asks; only chunks whose ACL names them are searched.
            k: hits returned.
            candidates: hits fetched from the vector search before reranking.
            rerank: apply the cross-encoder (when one is configured).
        """
        timings: dict[str, float] = {}
        t = time.perf_counter()
        self.index.refresh()
        allowed = self.index.catalog.allowed_chunk_ids(self.index.name, store_filter(principal))
        timings["acl_filter"] = time.perf_counter() - t

        t = time.perf_counter()
        query = self.embed_query(question)
        timings["embed"] = time.perf_counter() - t

        t = time.perf_counter()
        fetch = max(k, candidates if (rerank and self.reranker) else k)
        found = self.index.store.search(query, fetch, allowed)
        records = self.index.catalog.chunk_records([i for i, _ in found])
        hits = []
        for chunk_id, score in found:
            rec = records.get(chunk_id)
            # Post-check: drop anything the principal may not read, whatever the store said.
            if rec is None or not principal.can_read(rec.acl):
                continue
            hits.append(Hit(
                chunk_id=rec.id, document_key=rec.document_key, source=rec.source,
                chunk_index=rec.index, text=rec.text, score=score, heading=rec.heading,
                title=rec.title, acl=rec.acl,
            ))
        timings["search"] = time.perf_counter() - t

        if rerank and self.reranker is not None and hits:
            t = time.perf_counter()
            hits = self.reranker.rerank(question, hits, top_n=k)
            timings["rerank"] = time.perf_counter() - t
        return RetrievalResult(hits=hits[:k], timings=timings, num_allowed=len(allowed))
