"""The relevance people are shown: sigmoid of the cross-encoder's logit, None where a score is no probability."""

from __future__ import annotations

import math

import pytest

from rag.prompts import canonical_order, citations_for
from rag.relevance import relevance
from rag.types import Hit

RESERVATION_Q = "Which Slurm reservation does the imaging group have on the GPU nodes?"


def test_a_reranked_logit_becomes_its_probability():
    assert relevance(0.0, reranked=True) == 0.5
    # The two scores of the issue, side by side: 6.41 and -0.16 read as 0.998 and 0.46.
    assert relevance(6.41, reranked=True) == pytest.approx(1 / (1 + math.exp(-6.41)))
    assert round(relevance(6.41, reranked=True), 3) == 0.998
    assert round(relevance(-0.16, reranked=True), 2) == 0.46
    scores = [-12.0, -5.0, -0.16, 0.0, 0.3, 6.41, 11.0]
    values = [relevance(s, reranked=True) for s in scores]
    assert values == sorted(values) and all(0.0 < v < 1.0 for v in values)


def test_extreme_logits_do_not_overflow():
    assert relevance(1000.0, reranked=True) == 1.0
    assert relevance(-1000.0, reranked=True) == 0.0


def test_a_two_label_models_score_gives_the_softmax_of_relevant():
    # CrossEncoderReranker scores a 2-label model as logit[1] - logit[0].
    l0, l1 = 0.7, 2.2
    softmax_relevant = math.exp(l1) / (math.exp(l0) + math.exp(l1))
    assert relevance(l1 - l0, reranked=True) == pytest.approx(softmax_relevant)


@pytest.mark.parametrize("score", [0.83, 0.016, 12.5, -0.2])
def test_search_scores_get_no_relevance(score):
    # A cosine similarity, a BM25 score or a fused reciprocal rank is not a probability.
    assert relevance(score, reranked=False) is None


def test_a_score_that_is_not_a_number_gets_none():
    assert relevance(math.nan, reranked=True) is None
    assert relevance(math.inf, reranked=True) is None


def _hit(chunk_id: int, key: str, score: float) -> Hit:
    return Hit(chunk_id=chunk_id, document_key=key, source=key, chunk_index=0, text=f"text {chunk_id}", score=score)


def test_citations_keep_the_raw_score_and_carry_relevance_and_rank():
    ranked = [_hit(7, "/b.md", 6.41), _hit(3, "/a.md", -0.16), _hit(9, "/c.md", 1.0)]
    cites = citations_for(canonical_order(ranked), ranked, reranked=True)
    assert [c.document_key for c in cites] == ["/a.md", "/b.md", "/c.md"]  # prompt order, not rank order
    assert [c.number for c in cites] == [1, 2, 3]
    assert [c.rank for c in cites] == [2, 1, 3]
    assert [c.score for c in cites] == [-0.16, 6.41, 1.0]
    assert [c.relevance for c in cites] == [relevance(s, True) for s in (-0.16, 6.41, 1.0)]
    unreranked = citations_for(canonical_order(ranked), ranked, reranked=False)
    assert [c.relevance for c in unreranked] == [None, None, None]
    assert [c.rank for c in unreranked] == [2, 1, 3]


def test_the_pipeline_gives_reranked_citations_their_relevance(lab_rag):
    bob = lab_rag.principal("bob")
    reranked = lab_rag.query(RESERVATION_Q, bob, k=3, generate=False)
    assert reranked.citations
    for c in reranked.citations:
        assert c.relevance == relevance(c.score, reranked=True)
    best = min(reranked.citations, key=lambda c: c.rank)
    assert "gpu-reservation" in best.source and best.relevance > 0.5
    assert sorted(c.rank for c in reranked.citations) == list(range(1, len(reranked.citations) + 1))


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_unreranked_citations_show_a_rank_and_no_relevance(lab_rag, mode):
    answer = lab_rag.query(RESERVATION_Q, lab_rag.principal("bob"), k=3, generate=False, rerank=False, mode=mode)
    assert answer.citations
    assert all(c.relevance is None for c in answer.citations)
    by_rank = sorted(answer.citations, key=lambda c: c.rank)
    assert [c.score for c in by_rank] == sorted((c.score for c in answer.citations), reverse=True)


def test_the_pipeline_times_model_loading_apart_from_the_work(lab_rag):
    answer = lab_rag.query(RESERVATION_Q, lab_rag.principal("bob"), k=3, generate=False, mode="hybrid")
    assert {"load_embedder", "load_reranker", "embed", "rerank", "total"} <= set(answer.timings)
    keyword = lab_rag.query(RESERVATION_Q, lab_rag.principal("bob"), k=3, generate=False, mode="keyword",
                            rerank=False)
    # A keyword-only query without the reranker loads neither model.
    assert not any(name.startswith("load_") for name in keyword.timings)
