"""Reciprocal rank fusion: one ranking from several (dense and keyword hits, say).

RRF uses only ranks, so it needs no calibration between a cosine similarity and a BM25
score, which live on unrelated scales (Cormack, Clarke and Büttcher, SIGIR 2009).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rag.types import Hit

RRF_K = 60  # the constant of the paper: damps the advantage of the very first ranks


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[tuple[int, float]]], k: int = RRF_K, limit: int | None = None,
    ties_by_first: bool = False,
) -> list[tuple[int, float]]:
    """Fuse rankings of (id, score), each best first, by the sum of 1 / (k + rank).

    Ranks start at 1; the input scores are ignored except through the order they gave. An
    id found by one ranking only still gets that ranking's share. An id repeated within one
    ranking counts at its best rank there (a store should not return it twice, but one
    that does must not get a double vote).

    Args:
        rankings: any number of rankings, each a best-first list of (id, score).
        k: the RRF constant, >= 0; larger values flatten the difference between ranks.
        limit: return at most this many (all when None).
        ties_by_first: equal scores in the first ranking's order (ids it lacks after those it
            has), then by id. Two rankings that swap two items give them equal scores, and ids
            are only insertion order: a re-ingested collection and a fresh one number chunks
            differently, so an id tie-break would order the same content differently.

    Returns:
        (id, fused score) best first; equal scores in ascending id order (unless
        ties_by_first), so the result does not depend on the order of `rankings`.

    Raises:
        ValueError: k < 0 or limit < 0.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    shares: dict[int, list[float]] = {}
    for ranking in rankings:
        seen: set[int] = set()
        for rank, (item, _) in enumerate(ranking, start=1):
            if item in seen:
                continue
            seen.add(item)
            shares.setdefault(item, []).append(1.0 / (k + rank))
    # fsum is exactly rounded, so equal rank multisets give bit-equal scores whatever the
    # order of the rankings, and the id tie-break then decides.
    first: dict[int, int] = {}
    if ties_by_first and rankings:
        for rank, (item, _) in enumerate(rankings[0]):
            first.setdefault(item, rank)
    never = len(first)
    ordered = sorted(((item, math.fsum(s)) for item, s in shares.items()),
                     key=lambda p: (-p[1], first.get(p[0], never), p[0]))  # fmt: skip
    return ordered if limit is None else ordered[:limit]


def fuse_reranked(retrieved: Sequence[Hit], reranked: Sequence[Hit], k: int = RRF_K) -> list[Hit]:
    """The reranker's hits in the order of RRF over the retrieval order and the reranker's order.

    The cross-encoder alone sometimes pushes the chunk that both legs ranked first below
    near-duplicates that repeat the question's words (release notes, option lists); fusing
    keeps its judgement as one vote instead of the only one. Each hit keeps the reranker's
    score (relevance thresholds and display read it); ties go to the reranker's order.

    Args:
        retrieved: the hits best first as retrieval (and fusion of its legs) ranked them.
        reranked: the same hits (by chunk_id), best first by the reranker, with its scores.
        k: the RRF constant.

    Returns:
        `reranked`'s hits, reordered.
    """
    fused = reciprocal_rank_fusion([[(h.chunk_id, h.score) for h in retrieved],
                                    [(h.chunk_id, h.score) for h in reranked]], k=k)
    fused_score = dict(fused)
    order = {h.chunk_id: i for i, h in enumerate(reranked)}
    return sorted(reranked, key=lambda h: (-fused_score[h.chunk_id], order[h.chunk_id]))
