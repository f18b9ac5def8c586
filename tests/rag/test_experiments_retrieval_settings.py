"""The dense_feedback, max_hits_per_document and page_evidence keys of an experiment's Config: parsed, validated,
labelled, and applied to that configuration's queries only (no index built, the Rag's settings
untouched). What reaches the retriever is shown by what it returns and by counted calls, never by time."""

from __future__ import annotations

from collections import Counter

import pytest

from rag.errors import ConfigError
from rag.experiments import Config, Experiment, grid, parse_config, read_questions
from tests.rag.conftest import LAB_DOCS

QUESTIONS = LAB_DOCS.parent / "questions.jsonl"


def test_both_keys_parse_and_show_in_the_label():
    config = parse_config("mode=hybrid,dense_feedback=off,max_hits_per_document=1")
    assert (config.mode, config.dense_feedback, config.max_hits_per_document) == ("hybrid", False, 1)
    assert config.label == "hybrid + rerank, k=5, dense feedback off, max 1 per document"
    assert parse_config("feedback=on, max_per_document=0").label == (
        "hybrid + rerank, k=5, dense feedback on, no per-document cap")
    # unset: the settings' values, and the label of a plain configuration is what it was
    assert (Config().dense_feedback, Config().max_hits_per_document, Config().label) == (None, None,
                                                                                         "hybrid + rerank, k=5")
    # retrieval settings, not index settings: no configuration of them needs its own index
    assert parse_config("dense_feedback=off,max_hits_per_document=3").index_settings() == {}
    evidence = parse_config("max_hits_per_document=1,page_evidence=0.2")
    assert evidence.page_evidence == 0.2
    assert evidence.label == "hybrid + rerank, k=5, max 1 per document, page evidence 0.2"
    assert evidence.index_settings() == {}
    assert [c.label for c in grid(dense_feedback=[True, False])] == ["hybrid + rerank, k=5, dense feedback on",
                                                                     "hybrid + rerank, k=5, dense feedback off"]


@pytest.mark.parametrize(("text", "message"), [
    ("dense_feedback=sometimes", "dense_feedback must be on or off, got 'sometimes'"),
    ("max_hits_per_document=two", "max_hits_per_document must be a whole number, got 'two'"),
    ("max_hits_per_document=-1", r"max_hits_per_document must be a whole number between 0 and 100 \(0: no cap\)"),
    ("max_hits_per_document=101", "between 0 and 100"),
    ("page_evidence=some", "page_evidence must be a number, got 'some'"),
    ("page_evidence=1.5", "page_evidence must be a number between 0 and 1, got 1.5"),
    ("page_evidence=-0.1", "between 0 and 1"),
])
def test_bad_values_are_refused_with_the_valid_ones(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


@pytest.mark.parametrize("values", [{"max_hits_per_document": True}, {"max_hits_per_document": 1.5},
                                    {"dense_feedback": "off"}, {"dense_feedback": 0}, {"page_evidence": "0.1"},
                                    {"page_evidence": True}])
def test_the_api_refuses_values_of_the_wrong_type(values):
    # bool is an int and "off" is truthy in Python: either would quietly mean something else.
    with pytest.raises(ConfigError, match="must be"):
        Config(**values)


def _repeats(retrieved: list[str]) -> bool:
    return any(n > 1 for n in Counter(retrieved).values())


@pytest.mark.slow
def test_max_hits_per_document_reaches_the_retriever(lab_rag, lab_copy):
    questions = read_questions(QUESTIONS)
    settings = lab_rag.settings
    configs = [Config(rerank=False), Config(rerank=False, max_hits_per_document=2),
               Config(rerank=False, max_hits_per_document=0)]
    with Experiment(lab_rag, root=lab_copy, progress=False) as exp:
        df = exp.run(questions, configs)
        assert exp.builds() == []  # a retrieval setting: the ingested collection, nothing built
    assert lab_rag.settings is settings and settings.max_hits_per_document == 1
    by_config = {label: rows for label, rows in df.groupby("config", sort=False)}
    default, two, uncapped = (by_config[c.label] for c in configs)
    assert list(two["max_hits_per_document"].unique()) == [2] and list(default["max_hits_per_document"]) == [1] * len(
        default)
    # The cap only fills from other documents while there are some: every asker in the sample set
    # reads more than five documents, so with the default cap (one) no document comes back twice,
    # while a cap of two does let one document take two places.
    assert not any(_repeats(r) for r in default["retrieved"])
    assert any(_repeats(r) for r in two["retrieved"])
    assert max(max(Counter(r).values()) for r in two["retrieved"]) == 2
    assert max(max(Counter(r).values()) for r in uncapped["retrieved"]) > 2  # 0: no cap at all
    assert (df["leaks"] == 0).all()


def test_page_evidence_reaches_the_retriever(lab_rag, lab_copy):
    questions = read_questions(QUESTIONS)
    configs = [Config(rerank=False, max_hits_per_document=1, page_evidence=0.0),
               Config(rerank=False, max_hits_per_document=1, page_evidence=1.0)]
    with Experiment(lab_rag, root=lab_copy, progress=False) as exp:
        df = exp.run(questions, configs)
        assert exp.builds() == []
    assert lab_rag.settings.page_evidence == 0.0  # the Rag's own setting is untouched
    by_config = {label: rows for label, rows in df.groupby("config", sort=False)}
    none, full = (by_config[c.label] for c in configs)
    assert list(none["page_evidence"].unique()) == [0.0] and list(full["page_evidence"].unique()) == [1.0]
    # A weight of 1 lets a document's second chunk count as much as its best: some questions'
    # documents come in another order (or others come in), one a document either way.
    assert any(a != b for a, b in zip(none["retrieved"], full["retrieved"], strict=True))
    assert not any(_repeats(r) for r in full["retrieved"]) and (df["leaks"] == 0).all()


@pytest.fixture
def counted(lab_rag, monkeypatch):
    """Counts of the Rag's query embeddings (texts, calls) and of its collection's dense searches."""
    counts = Counter()
    embedder = lab_rag.query_embedder
    store = lab_rag.collection()
    search = store.search

    class Counting:
        def __call__(self, text):
            counts["embedded_texts"] += 1
            return embedder(text)

        def many(self, texts):
            counts["embedded_texts"] += len(texts)
            counts["passage_batches"] += 1
            return embedder.many(texts)

    def counting_search(*args, **kwargs):
        counts["searches"] += 1
        return search(*args, **kwargs)

    monkeypatch.setattr(lab_rag, "query_embedder", Counting())
    monkeypatch.setattr(store, "search", counting_search)
    return counts


def test_dense_feedback_off_runs_fewer_searches_and_embeddings(lab_rag, lab_copy, counted):
    questions = read_questions(QUESTIONS).questions[:6]
    work = {}
    with Experiment(lab_rag, root=lab_copy, progress=False) as exp:
        for feedback in (True, False):
            counted.clear()
            df = exp.run(questions, Config(rerank=False, dense_feedback=feedback))
            work[feedback] = dict(counted)
            assert list(df["dense_feedback"]) == [feedback] * len(questions)
            assert df["feedback_ms"].notna().all() == feedback  # the stage shows in the latency columns
        assert exp.builds() == []
    n = len(questions)
    # off: one question embedding and one dense search per question; on: also one batch of
    # feedback passages and a second dense search each
    assert work[False] == {"embedded_texts": n, "searches": n}
    assert work[True]["searches"] == 2 * n and work[True]["passage_batches"] == n
    assert work[True]["embedded_texts"] > work[False]["embedded_texts"]
    assert lab_rag.settings.dense_feedback  # the Rag's setting is untouched


def test_the_default_follows_the_rags_settings(lab_rag, lab_copy, rag_factory):
    question = read_questions(QUESTIONS).questions[0]
    off = rag_factory(lab_rag.settings.home, dense_feedback=False, max_hits_per_document=0)
    try:
        with Experiment(off, root=lab_copy, progress=False) as exp:
            row = exp.run([question], Config(rerank=False)).iloc[0]
    finally:
        off.close()
    assert (row["dense_feedback"], row["max_hits_per_document"]) == (False, 0)


@pytest.mark.parametrize("value", [True, -1, 101, 1.5, "2"])
def test_rag_query_refuses_a_bad_per_document_cap_in_its_own_words(lab_rag, value):
    # True used to pass as 1, and -1 failed with the retriever's internal argument name.
    with pytest.raises(ConfigError, match=r"max_hits_per_document must be a whole number between 0 and 100"):
        lab_rag.query("How do I book the confocal microscope?", lab_rag.principal("carol"), generate=False,
                      max_hits_per_document=value)
