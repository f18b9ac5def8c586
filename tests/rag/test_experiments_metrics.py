"""Retrieval and answer metrics of rag.experiments against values computed by hand."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from rag.errors import ConfigError
from rag.experiments.answer_metrics import is_refusal, score_answer
from rag.experiments.configs import Config, grid, parse_config
from rag.experiments.metrics import first_relevant_rank, ndcg_at, recall_at, reciprocal_rank
from rag.types import Citation

# Five hits, best first: two chunks of b (records of a labelled JSONL file), then c.
RANKED = ["a.md", "x.md", "b.jsonl#1", "b.jsonl#2", "c.md"]
RELEVANT = {"b.jsonl", "c.md", "d.md"}


def test_rank_recall_and_mrr_by_source():
    assert first_relevant_rank(RANKED, RELEVANT) == 3
    assert recall_at(RANKED, RELEVANT, 1) == 0.0
    assert recall_at(RANKED, RELEVANT, 3) == pytest.approx(1 / 3)
    # b's second chunk adds nothing: each source is credited once
    assert recall_at(RANKED, RELEVANT, 4) == pytest.approx(1 / 3)
    assert recall_at(RANKED, RELEVANT, 5) == pytest.approx(2 / 3)
    assert reciprocal_rank(RANKED, RELEVANT) == pytest.approx(1 / 3)
    assert reciprocal_rank(["a.md"], RELEVANT) == 0.0


def test_ndcg_with_graded_relevance():
    grades = {"b.jsonl": 2, "c.md": 1, "d.md": 1}
    # DCG: b (grade 2) first at rank 3, c (1) at rank 5: 2/log2(4) + 1/log2(6)
    dcg = 2 / 2 + 1 / math.log2(6)
    # ideal: 2, 1, 1 at ranks 1, 2, 3
    idcg = 2 / 1 + 1 / math.log2(3) + 1 / 2
    assert ndcg_at(RANKED, grades, 5) == pytest.approx(dcg / idcg)
    assert ndcg_at(RANKED, grades, 5) == pytest.approx(0.442952, abs=1e-6)
    assert ndcg_at(["c.md", "b.jsonl#1"], {"c.md": 1, "b.jsonl": 1}, 2) == pytest.approx(1.0)
    assert ndcg_at(RANKED, grades, 2) == 0.0


def test_nothing_relevant_is_undefined_not_perfect():
    assert math.isnan(recall_at(RANKED, set(), 5))
    assert math.isnan(reciprocal_rank(RANKED, set()))
    assert math.isnan(ndcg_at(RANKED, {}, 5))
    assert first_relevant_rank(RANKED, set()) is None


def _citation(number: int, text: str) -> Citation:
    return Citation(number=number, document_key=f"/docs/{number}", source=f"{number}", chunk_index=0, score=1.0,
                    text=text)


def test_citation_precision_and_expected_fact():
    citations = [_citation(1, "Alarm set point: -65 C."), _citation(2, "the alarm triggers at -65   c"),
                 _citation(3, "Freezer rota for March.")]
    labels = ["genomics/freezer-inventory.txt", "public/other.md", "public/rota.md"]
    text = "The alarm is at -65 C [1]. See also [2, 3] and [9]."
    score = score_answer(text, citations, labels, {"genomics/freezer-inventory.txt"}, "-65 C", should_refuse=False)
    # markers 1, 2, 3, 9: [1] is a relevant source, [2] contains the fact (case and spaces
    # ignored), [3] neither, [9] points at no source
    assert (score.markers, score.correct_markers) == (4, 2)
    assert score.citation_precision == 0.5
    assert score.expected_found is True
    assert (score.refused, score.refusal, score.refusal_correct) == (False, "answered", True)


def test_refusal_outcomes():
    no_answer = "I don't know: none of the documents you may read answer this question."
    assert score_answer(no_answer, [], [], set(), None, should_refuse=True).refusal == "correct refusal"
    assert score_answer("I do not know.", [], [], {"a.md"}, "42", should_refuse=False).refusal == "false refusal"
    wrong = score_answer("Use FRZ-80-A [1].", [_citation(1, "FRZ-80-A")], ["g/x.txt"], set(), None, True)
    assert (wrong.refusal, wrong.refusal_correct, wrong.correct_markers) == ("wrong answer", False, 0)
    assert is_refusal(None) and is_refusal("  ") and is_refusal("I can't answer that")
    assert not is_refusal("It is 72 hours; I don't know more.")
    assert math.isnan(score_answer("Plain text.", [], [], {"a.md"}, None, False).citation_precision)


def test_config_parsing_and_labels():
    config = parse_config("mode=dense, rerank=off, k=10, chunk=100, overlap=16")
    assert config == Config(mode="dense", rerank=False, k=10, chunk_max_tokens=100, chunk_overlap_tokens=16)
    assert config.label == "dense, k=10, chunks=100/16"
    assert config.index_settings() == {"chunk_max_tokens": 100, "chunk_overlap_tokens": 16}
    assert parse_config("name=baseline").label == "baseline"
    titled = parse_config("chunk=100, title_context=on")
    assert titled.index_settings() == {"chunk_max_tokens": 100, "chunk_title_context": True}
    assert titled.label == "hybrid + rerank, k=5, chunks=100/0, title context on"
    with pytest.raises(ConfigError, match="chunk_title_context must be on or off"):
        parse_config("title_context=sometimes")
    assert [c.label for c in grid(mode=["keyword", "hybrid"], rerank=[False, True])] == [
        "keyword, k=5", "keyword + rerank, k=5", "hybrid, k=5", "hybrid + rerank, k=5"]
    with pytest.raises(ConfigError, match="dense, keyword, hybrid"):
        parse_config("mode=fuzzy")
    with pytest.raises(ConfigError, match="key among"):
        parse_config("topk=3")
    with pytest.raises(ConfigError, match="on or off"):
        parse_config("rerank=maybe")
    with pytest.raises(ConfigError, match="between 1 and 100"):
        Config(k=0)


def test_leaks_fail_closed():
    """Unit test of StoredAcls: a hit counts as a leak unless the stored ACL and the hit's own ACL let the asker in."""
    from rag.experiments.ground_truth import StoredAcls
    from rag.experiments.questions import Question
    from rag.types import Hit
    from retrieval.records import DocumentState

    states = {key: DocumentState(i, key, "h", acl, 1) for i, (key, acl) in enumerate({
        "/c/public/a.md": frozenset({"public"}),
        "/c/team/b.md": frozenset({"group:team"}),
        "/c/notes.jsonl#1": frozenset({"public"}),
        "/c/notes.jsonl#2": frozenset({"group:team"}),
    }.items())}
    acls = StoredAcls(states, "/c")

    def hit(key: str, acl: frozenset[str] = frozenset({"public"})) -> Hit:
        return Hit(chunk_id=1, document_key=key, source=key, chunk_index=0, text="t", score=1.0, acl=acl)

    olga = Question("q", "anything", "olga", sources=("team/b.md", "notes.jsonl"), forbidden=("public/a.md",))
    hits = [hit("/c/notes.jsonl#1"), hit("/c/team/b.md", frozenset({"group:team"})),
            hit("/c/gone.md"),  # not in the store: fail closed
            hit("/c/public/a.md"),  # readable, but the set forbids it
            hit("/c/notes.jsonl#2", frozenset({"public"}))]  # the hit says public, the stored ACL says team
    assert acls.leaks(olga, hits) == ["team/b.md", "gone.md", "public/a.md", "notes.jsonl#2"]
    truth = acls.truth(olga)
    # a labelled JSONL file is readable through any readable record; team/b.md is not a miss for olga
    assert (truth.relevant, truth.unreadable, truth.should_refuse) == (
        frozenset({"notes.jsonl"}), frozenset({"team/b.md"}), False)
    tess = Question("q", "anything", "tess", ("team",), sources=("team/b.md", "missing.md"))
    assert acls.truth(tess).unknown == frozenset({"missing.md"}) and acls.leaks(tess, [hit("/c/team/b.md")]) == []


def test_title_context_makes_its_own_variant_and_off_keeps_the_old_name(tmp_path):
    from rag.experiments.variants import spec_key
    from rag.settings import load_settings

    base = load_settings(home=tmp_path, chunk_title_context=False)
    on = base.model_copy(update={"chunk_title_context": True})
    assert spec_key(on, "default") != spec_key(base, "default")
    # Off, the name is what it was before the setting existed, so built variants are found again.
    before = {"embedder": base.embedder, "chunk_max_tokens": base.chunk_max_tokens, "store": base.store,
              "chunk_overlap_tokens": base.chunk_overlap_tokens, "dsn": None, "collection": "default"}
    assert spec_key(base, "default") == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:12]
