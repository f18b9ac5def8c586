"""The Retriever's final order with a reranker: fused with the retrieval order, or the reranker's alone.

A fake store and reranker are right here (a unit test of the Retriever's ordering): the
reranker's ranking is chosen to disagree with retrieval, which no real model guarantees.
"""

from __future__ import annotations

import numpy as np

from permissions.models import Principal
from rag.types import Hit
from retrieval.records import ChunkRecord
from retrieval.retriever import Retriever


class FiveChunkStore:
    """Chunks 0..4 of five public documents, ranked 0 first by both legs."""

    name = "five"

    def refresh(self) -> bool:
        return False

    def search(self, query, k, tokens, exact=False):
        return [(i, 1.0 - i / 10) for i in range(5)][:k]

    def keyword_search(self, text, k, tokens):
        return self.search(None, k, tokens)

    def chunk_records(self, ids):
        return {i: ChunkRecord(i, f"d{i}", f"d{i}", None, 0, f"text {i}", None, frozenset({"public"})) for i in ids}


class LastFirstReranker:
    """Scores chunk 0 lowest and the others in retrieval order: 1 > 2 > 3 > 4 > 0."""

    scores = {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 0: 1.0}

    def rerank(self, query, hits, top_n=None):
        rescored = [Hit(**{**h.__dict__, "score": self.scores[h.chunk_id]}) for h in hits]
        return sorted(rescored, key=lambda h: -h.score)[:top_n]


def order(fuse: bool) -> list[tuple[int, float]]:
    retriever = Retriever(FiveChunkStore(), lambda q: np.ones(4, dtype=np.float32), LastFirstReranker(),
                          max_per_document=None, fuse_rerank=fuse)
    hits = retriever.retrieve("q", Principal("pat"), k=3, candidates=5, rerank=True, mode="dense").hits
    return [(h.chunk_id, h.score) for h in hits]


def test_fused_order_keeps_the_chunk_retrieval_ranked_first_in_the_top_k() -> None:
    assert order(fuse=True) == [(1, 9.0), (2, 8.0), (0, 1.0)]  # the reranker's scores, fused order
    assert order(fuse=False) == [(1, 9.0), (2, 8.0), (3, 7.0)]  # the reranker alone drops chunk 0


def test_fusing_is_the_default() -> None:
    retriever = Retriever(FiveChunkStore(), lambda q: np.ones(4, dtype=np.float32), LastFirstReranker())
    assert retriever.fuse_rerank is True
