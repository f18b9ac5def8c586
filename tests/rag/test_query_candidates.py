"""`Rag.query(candidates=...)`: how many hits retrieval hands to the reranker, per query.

Measured by what the reranker is given (a count of the passages it scores), never by time.
"""

from __future__ import annotations

import pytest

from rag.errors import ConfigError
from rag.experiments import Config, Experiment, read_questions
from tests.rag.conftest import LAB_DOCS

GPU = "Which GPU nodes can I use?"


@pytest.fixture
def reranked_sizes(lab_rag, monkeypatch):
    """The number of hits of every call to the Rag's reranker."""
    sizes: list[int] = []
    reranker = lab_rag.batched_reranker
    real = reranker.rerank

    def counting(query, hits, top_n=None):
        sizes.append(len(hits))
        return real(query, hits, top_n)

    monkeypatch.setattr(reranker, "rerank", counting)
    return sizes


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_candidates_sets_how_many_hits_the_reranker_scores(lab_rag, reranked_sizes, mode):
    carol = lab_rag.principal("carol")  # hpc-admins: reads far more than 12 chunks
    for candidates in (3, 12):
        answer = lab_rag.query(GPU, carol, k=2, generate=False, mode=mode, candidates=candidates)
        assert len(answer.hits) == 2
    default = lab_rag.query(GPU, carol, k=2, generate=False, mode=mode)
    assert default.hits
    assert reranked_sizes == [3, 12, lab_rag.settings.candidates]


def test_a_stream_takes_candidates_too(lab_rag, reranked_sizes):
    answer, pieces = lab_rag.stream(GPU, lab_rag.principal("carol"), k=2, candidates=5)
    assert "".join(pieces) and len(answer.hits) == 2 and reranked_sizes == [5]


def test_at_least_k_candidates_are_fetched(lab_rag, reranked_sizes):
    carol = lab_rag.principal("carol")
    answer = lab_rag.query(GPU, carol, k=4, generate=False, candidates=1, max_hits_per_document=0)
    assert len(answer.hits) == 4 and reranked_sizes == [4]
    # Under the default cap (1 a document) four candidates from fewer than four documents cannot
    # fill four places: a deeper search follows, and its new hits of other documents are scored.
    reranked_sizes.clear()
    capped = lab_rag.query(GPU, carol, k=4, generate=False, candidates=1)
    documents = [h.document_key for h in capped.hits]
    assert reranked_sizes[0] == 4 and len(reranked_sizes) <= 2
    assert len(documents) == 4 and len(set(documents)) == 4


@pytest.mark.parametrize("bad", [0, -3, 1001, True, 2.5, "5", None])
def test_a_bad_candidates_value_is_refused_before_any_work(lab_rag, reranked_sizes, bad):
    if bad is None:  # None is the default: the setting's value
        lab_rag.query(GPU, lab_rag.principal("dave"), k=2, generate=False, candidates=None)
        assert reranked_sizes == [lab_rag.settings.candidates]
        return
    with pytest.raises(ConfigError, match=r"candidates must be a whole number between 1 and 1000"):
        lab_rag.query(GPU, lab_rag.principal("dave"), k=2, generate=False, candidates=bad)
    assert reranked_sizes == []


def test_an_experiments_candidates_reach_the_reranker_without_touching_the_settings(lab_rag, reranked_sizes):
    question = next(q for q in read_questions(LAB_DOCS.parent / "questions.jsonl").questions if q.user == "carol")
    settings = lab_rag.settings
    with Experiment(lab_rag, root=LAB_DOCS, progress=False) as exp:
        df = exp.run([question], [Config(k=3, candidates=7), Config(k=3)])
    assert reranked_sizes == [7, settings.candidates]
    assert list(df["candidates"]) == [7, settings.candidates]
    assert lab_rag.settings is settings  # nothing swapped in and out around the query
