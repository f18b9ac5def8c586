"""At most N hits per document in the top k, so one long page cannot fill the whole answer context.

A reference page cut into many similar chunks often takes every one of the top 5 places for a
question that another page answers better; capping each document leaves room for the next
candidates. The cap only reorders hits the caller already holds (post-checked ones), so it can
never bring in a chunk the principal may not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from rag.types import Hit


def cap_per_document(hits: Sequence[Hit], k: int, max_per_document: int | None,
                     family: Callable[[Hit], str] | None = None) -> list[Hit]:
    """The first `k` of `hits` (best first) with at most `max_per_document` from any one document.

    Places a capped document would take go to the next hits of other documents, in order. When
    there are not enough of those, the skipped hits fill the rest, best first, after the others:
    fewer hits would leave the generator less to work with and make none of them more relevant.

    Args:
        hits: best first, already permission-checked.
        k: how many to return (>= 0).
        max_per_document: the cap (>= 1), or None for no cap.
        family: a key of pages that count as one document for the cap too (e.g.
            `retrieval.page_families.page_family`: the release notes of every minor version).

    Raises:
        ValueError: k < 0 or max_per_document < 1.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if max_per_document is None:
        return list(hits[:k])
    if max_per_document < 1:
        raise ValueError(f"max_per_document must be >= 1 or None, got {max_per_document}")
    kept, skipped = split_by_cap(hits, max_per_document, family)
    kept = kept[:k]
    # Fillers go after every hit within the cap: another page beats a document's third chunk.
    return kept + skipped[:k - len(kept)]


def split_by_cap(hits: Sequence[Hit], max_per_document: int,
                 family: Callable[[Hit], str] | None = None) -> tuple[list[Hit], list[Hit]]:
    """`hits` (best first) split into those within the cap and those past it, each in order.

    A hit is within the cap while its document, and its family when `family` is given, has
    taken fewer than `max_per_document` places before it.
    """
    kept: list[Hit] = []
    skipped: list[Hit] = []
    per_document: Counter[str] = Counter()
    per_family: Counter[str] = Counter()
    for hit in hits:
        group = family(hit) if family is not None else None
        if per_document[hit.document_key] < max_per_document and (
                group is None or per_family[group] < max_per_document):
            per_document[hit.document_key] += 1
            if group is not None:
                per_family[group] += 1
            kept.append(hit)
        else:
            skipped.append(hit)
    return kept, skipped


# Off by default. Measured on the PostgreSQL manual set and the sample corpus (docs/benchmarks.md,
# 2026-12-04): with one hit per page, weights of 0.02 to 0.10 give the manual recall@5 0.905 by
# page against 0.896 with none, but sink the sample corpus's MRR@5 (hybrid + rerank 0.969 ->
# 0.880 at 0.05): there most relevant documents are a chunk or two long, and any weight above
# 1/60 lets a page at places 2 and 3 pass one at place 1. (Counting every other chunk of a page,
# not the second alone, sinks it further: 0.782.)
PAGE_EVIDENCE = 0.0
_RANK_K = 60  # the RRF constant: a position's score is 1 / (_RANK_K + rank), as in the fusion


def rank_pages(orders: Sequence[Sequence[Hit]], k: int, evidence: float = PAGE_EVIDENCE,
               family: Callable[[Hit], str] | None = None) -> list[Hit]:
    """One hit per document in the top `k`: documents ordered by their chunks' places in `orders`.

    Each order is one vote of reciprocal-rank fusion over documents: in it, a chunk at position
    r (from 1) scores 1 / (60 + r), and a document scores its best chunk's score plus `evidence`
    times its second-best chunk's score; a document's votes add up over the orders. Pages are
    thus fused by their best chunk in each order (the retrieval order's and the reranker's),
    not by one chunk's fused place: a page whose answering chunk the reranker puts first while
    retrieval found another of its chunks first keeps both votes. The evidence weight is small
    and only one more chunk counts, so a long page's many middling chunks cannot add up past a
    better page.

    Args:
        orders: rankings of the same hits (by chunk_id), best first, already permission-checked.
            The first one's hits are returned (the reranker's, carrying its scores); the
            others only vote.
        k: how many to return (>= 0).
        evidence: the weight of a document's second-best chunk (>= 0; 0, the default: the best
            chunk alone).
        family: a key of pages that count as one document (e.g. the release notes of each minor
            version, `retrieval.page_families.page_family`): one hit per family, the best one.

    Returns:
        At most `k` hits: one per document (and family), each document's best chunk in the
        first order; when there are fewer documents than `k`, the rest of the places are filled
        with the first order's remaining hits (another page's chunk beats none).

    Raises:
        ValueError: k < 0, evidence < 0, or no orders.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if evidence < 0:
        raise ValueError(f"evidence must be >= 0, got {evidence}")
    if not orders:
        raise ValueError("rank_pages needs at least one order")
    best: dict[str, Hit] = {}
    for hit in orders[0]:
        best.setdefault(hit.document_key, hit)
    scores: dict[str, float] = dict.fromkeys(best, 0.0)
    for order in orders:
        seen: set[str] = set()
        seconded: set[str] = set()
        for rank, hit in enumerate(order, start=1):
            key = hit.document_key
            if key not in scores:
                continue  # only the first order's documents are ranked
            share = 1.0 / (_RANK_K + rank)
            if key not in seen:
                seen.add(key)
                scores[key] += share
            elif key not in seconded:
                seconded.add(key)
                scores[key] += evidence * share
    # A stable sort of documents in the first order's order: ties keep it.
    pages = sorted(best.values(), key=lambda h: -scores[h.document_key])
    ranked = cap_per_document(pages, k, 1, family=family)
    if len(ranked) < k:
        taken = {id(h) for h in ranked}
        ranked += [h for h in orders[0] if id(h) not in taken][:k - len(ranked)]
    return ranked
