"""Permission-aware retrieval: a dense leg, a keyword leg, or both fused, then the reranker.

Both legs search only what the principal may read (the filter runs inside each store's
query), hits are post-checked against their stored ACL, and only then reranked and capped per
document. With one hit per document (the default), pages are fused, each by its best chunk in
the retrieval order and in the reranker's (retrieval.diversity.rank_pages), and each top page
names its next-best candidate chunk for the answer to read with it (retrieval.second_chunks);
with a larger cap, chunks are fused (the reranker's order with the retrieval order) and capped.
In hybrid mode a third, dense feedback leg (retrieval.feedback) starts from the best
post-checked hits. When the candidates come from too few documents to fill the top k under the
cap, the legs are searched again deeper for more (`DEEPEN`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from permissions.models import Principal
from permissions.policy import store_filter
from rag.errors import ConfigError
from rag.types import Hit
from retrieval.diversity import PAGE_EVIDENCE, cap_per_document, rank_pages, split_by_cap
from retrieval.feedback import FEEDBACK_HITS, feedback_query
from retrieval.fusion import fuse_reranked, reciprocal_rank_fusion
from retrieval.page_families import page_family
from retrieval.second_chunks import second_chunks

if TYPE_CHECKING:
    from retrieval.base import CollectionStore, Reranker

MODES = ("dense", "keyword", "hybrid")
# Measured on the PostgreSQL manual set (docs/benchmarks.md): see the settings of the same names.
MAX_HITS_PER_DOCUMENT = 1
FUSE_RERANK = True
DENSE_FEEDBACK = True
# When the capped candidates cannot fill the top k (18 of 20 candidates were release notes of
# one family for "upgrade from 14 to 15 without dumping"), each leg is searched again this many
# times deeper instead of filling the places with the capped pages' further chunks. In chunk
# order (a cap above 1) the new hits rank after the first ones; pages (a cap of 1) are fused
# over both passes. 2x to 5x all measured alike on the manual set.
DEEPEN = 3


@dataclass
class RetrievalResult:
    hits: list[Hit]
    timings: dict[str, float] = field(default_factory=dict)
    # With one hit per page: each hit's page's next-best candidate chunk, by the hit's chunk_id,
    # for the answer stage to read with it (retrieval.second_chunks).
    seconds: dict[int, Hit] = field(default_factory=dict)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown retrieval mode {mode!r}; choose one of: {', '.join(MODES)}")
    return mode


class Retriever:
    """legs (dense / keyword, each filtered by the principal's ACL) → fuse → post-check → rerank
    → at most `max_per_document` hits per document in the top k.

    Args:
        max_per_document: the per-document cap of the top k (None: no cap).
        fuse_rerank: order by RRF of the retrieval and the reranker's orders (True) or by the
            reranker alone (False). Hits carry the reranker's score either way.
        embed_passages: texts → (n, dim) L2-normalized rows in the query's space; needed for
            the feedback leg (None: no feedback leg).
        dense_feedback: in hybrid mode, fuse a third leg: a dense search from the query moved
            toward the first pass's best post-checked hits (retrieval.feedback).
        page_evidence: with a cap of 1, documents are ordered by their best chunk plus this
            weight times their second-best chunk's share (retrieval.diversity.rank_pages).
    """

    def __init__(self, store: CollectionStore, embed_query: Callable[[str], np.ndarray],
                 reranker: Reranker | None = None, max_per_document: int | None = MAX_HITS_PER_DOCUMENT,
                 fuse_rerank: bool = FUSE_RERANK,
                 embed_passages: Callable[[Sequence[str]], np.ndarray] | None = None,
                 dense_feedback: bool = DENSE_FEEDBACK, page_evidence: float = PAGE_EVIDENCE) -> None:
        if max_per_document is not None and max_per_document < 1:
            raise ConfigError(f"max_per_document must be >= 1 or None (no cap), got {max_per_document}")
        if page_evidence < 0:
            raise ConfigError(f"page_evidence must be >= 0, got {page_evidence}")
        self.store = store
        self.embed_query = embed_query
        self.reranker = reranker
        self.max_per_document = max_per_document
        self.fuse_rerank = fuse_rerank
        self.embed_passages = embed_passages
        self.dense_feedback = dense_feedback
        self.page_evidence = page_evidence

    def retrieve(self, question: str, principal: Principal, k: int = 5, candidates: int = 30,
                 rerank: bool = True, mode: str = "hybrid") -> RetrievalResult:
        """Top-k hits the principal may read, best first.

        Args:
            question: the user's question (non-empty).
            principal: who asks; only chunks whose ACL names them are searched.
            k: hits returned.
            candidates: hits fetched from each leg before fusion and reranking.
            rerank: apply the cross-encoder (when one is configured).
            mode: "dense" (embeddings), "keyword" (BM25 / full text) or "hybrid" (both,
                fused by reciprocal rank, with the dense feedback leg when it is on).
        """
        check_mode(mode)
        timings: dict[str, float] = {}
        tokens = sorted(store_filter(principal))
        self.store.refresh()
        # The cap needs spare candidates to fill the places it frees, as the reranker does.
        capped = self.max_per_document is not None and self.max_per_document < k
        fetch = max(k, candidates if ((rerank and self.reranker) or capped) else k)

        query = None
        if mode in ("dense", "hybrid"):
            t = time.perf_counter()
            query = self.embed_query(question)
            timings["embed"] = time.perf_counter() - t
        legs = self._legs(question, query, None, mode, fetch, tokens, timings)
        # Ties go to the first leg's order (dense when it runs): content, not chunk numbering.
        found = legs[0] if len(legs) == 1 else reciprocal_rank_fusion(legs, limit=fetch, ties_by_first=True)

        t = time.perf_counter()
        hits = self._readable_hits(found, principal)
        timings["fetch"] = time.perf_counter() - t

        feedback = None
        if mode == "hybrid" and self.dense_feedback and self.embed_passages is not None and hits:
            t = time.perf_counter()
            # Only post-checked hits feed back: unreadable text must not steer the ranking.
            passages = self.embed_passages([h.text for h in hits[:FEEDBACK_HITS]])
            feedback = feedback_query(query, passages)
            legs.append(self.store.search(feedback, fetch, tokens))
            fused = reciprocal_rank_fusion(legs, limit=fetch, ties_by_first=True)
            hits = self._readable_hits(fused, principal, known={h.chunk_id: h for h in hits})
            timings["feedback"] = time.perf_counter() - t

        # A leg that returned fewer than it was asked for has nothing more to give.
        more_exist = any(len(leg) >= fetch for leg in legs)
        scored = self._scored(question, hits, rerank, timings)
        ordered = self._chunk_order(hits, scored)
        kept = split_by_cap(ordered, self.max_per_document, page_family)[0] if capped and more_exist else None
        if kept is not None and len(kept) < k and hits:
            # Searched deeper with the same legs; in chunk order the new hits go after every
            # first one, so the deeper search only adds pages, never reorders those already found.
            t = time.perf_counter()
            deep = fetch * DEEPEN
            legs = self._legs(question, query, feedback, mode, deep, tokens, {})
            found = legs[0] if len(legs) == 1 else reciprocal_rank_fusion(legs, limit=deep, ties_by_first=True)
            seen = {h.chunk_id for h in hits}
            more = self._readable_hits([f for f in found if f[0] not in seen], principal)
            # Only pages that can still take a place are worth scoring: a deeper chunk of a page
            # (or page family) already at its cap would rank after it and never be used.
            per_document = Counter(h.document_key for h in kept)
            per_family = Counter(page_family(h) for h in kept)
            more = [h for h in more if per_document[h.document_key] < self.max_per_document
                    and per_family[page_family(h)] < self.max_per_document]
            timings["deepen"] = time.perf_counter() - t
            more_scored = self._scored(question, more, rerank, timings)
            ordered += self._chunk_order(more, more_scored)
            hits += more
            if scored is not None and more_scored is not None:
                # One cross-encoder, one question: the scores of both passes compare directly.
                scored = sorted(scored + more_scored, key=lambda h: -h.score)  # stable
        # After the post-check: the cap only chooses among hits the principal may read. Pages
        # that differ only in their numbers (release notes) share one cap (retrieval.page_families).
        if self.max_per_document == 1:
            # Pages, not chunks, are fused: each page by its best chunk in the reranker's order
            # and in the retrieval order (or in the one order there is).
            if scored is None:
                orders = [hits]
            else:
                orders = [scored, hits] if self.fuse_rerank else [scored]
            top = rank_pages(orders, k, self.page_evidence, family=page_family)
            return RetrievalResult(hits=top, timings=timings, seconds=second_chunks(top, orders[0]))
        top = cap_per_document(ordered, k, self.max_per_document, family=page_family)
        return RetrievalResult(hits=top, timings=timings)

    def _legs(self, question: str, query: np.ndarray | None, feedback: np.ndarray | None, mode: str,
              n: int, tokens: list[str], timings: dict[str, float]) -> list[list[tuple[int, float]]]:
        """Each leg's best `n` (id, score) that the tokens may read: dense, keyword, feedback."""
        legs: list[list[tuple[int, float]]] = []
        if query is not None:
            t = time.perf_counter()
            legs.append(self.store.search(query, n, tokens))
            timings["search"] = time.perf_counter() - t
        if mode in ("keyword", "hybrid"):
            t = time.perf_counter()
            legs.append(self.store.keyword_search(question, n, tokens))
            timings["keyword"] = time.perf_counter() - t
        if feedback is not None:
            legs.append(self.store.search(feedback, n, tokens))
        return legs

    def _scored(self, question: str, hits: list[Hit], rerank: bool, timings: dict[str, float]) -> list[Hit] | None:
        """`hits` in the reranker's order with its scores, or None when no reranker runs."""
        if not (rerank and self.reranker is not None and hits):
            return None
        t = time.perf_counter()
        # Every candidate is scored either way; the cap may need ranks past k.
        reranked = self.reranker.rerank(question, hits)
        timings["rerank"] = timings.get("rerank", 0.0) + time.perf_counter() - t
        return reranked

    def _chunk_order(self, hits: list[Hit], scored: list[Hit] | None) -> list[Hit]:
        """The chunks best first: the reranker's order fused with retrieval's (or its own), or retrieval's."""
        if scored is None:
            return hits
        return fuse_reranked(hits, scored) if self.fuse_rerank else scored

    def _readable_hits(self, found: list[tuple[int, float]], principal: Principal,
                       known: dict[int, Hit] | None = None) -> list[Hit]:
        """`found`'s chunks as hits, in order, without any the principal may not read.

        `known`: hits already fetched and post-checked (the first pass): reused with their new
        score instead of read from the store again.
        """
        known = known or {}
        records = self.store.chunk_records([i for i, _ in found if i not in known])
        hits = []
        for chunk_id, score in found:
            if chunk_id in known:
                hits.append(replace(known[chunk_id], score=score))
                continue
            rec = records.get(chunk_id)
            # Post-check: drop anything the principal may not read, whatever the store said.
            if rec is None or not principal.can_read(rec.acl):
                continue
            hits.append(Hit(
                chunk_id=rec.id, document_key=rec.document_key, source=rec.source,
                chunk_index=rec.index, text=rec.text, score=score, heading=rec.heading,
                title=rec.title, acl=rec.acl,
            ))
        return hits
