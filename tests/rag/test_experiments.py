"""rag.experiments end to end: real stores, real models, ground truth from the stored ACLs."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from rag.experiments import (
    Config,
    Experiment,
    Question,
    assert_no_leaks,
    plot_latency,
    plot_recall,
    read_questions,
    summarize,
)
from rag.experiments.answer_metrics import cited_numbers
from retrieval.evaluate import evaluate, load_questions
from tests.rag.test_experiments_sets import make_beir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LAB_DOCS = EXAMPLES / "lab-docs"
RESERVATION = "How long may a job run inside the imaging GPU reservation?"


@pytest.fixture(scope="module")
def small(tmp_path_factory, rag_factory):
    """A few text files of the sample corpus (quick to ingest) with their sidecars, ingested."""
    root = tmp_path_factory.mktemp("small") / "docs"
    for rel in ("imaging/.rag-acl.toml", "imaging/gpu-reservation.txt", "imaging/cryoem-booking.md",
                "public/.rag-acl.toml", "public/storage-quotas.txt", "public/cluster-user-guide.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(LAB_DOCS / rel, root / rel)
    rag = rag_factory(tmp_path_factory.mktemp("small-home"), max_new_tokens=24)
    assert rag.ingest([root], progress=False).ok
    yield rag, root
    rag.close()


def test_one_row_per_question_and_configuration(lab_rag, lab_copy):
    qset = read_questions(EXAMPLES / "questions.jsonl")
    configs = [Config(mode="dense", rerank=False), Config(mode="keyword", rerank=False, k=3)]
    with Experiment(lab_rag, root=lab_copy) as exp:
        df = exp.run(qset, configs)
        assert exp.builds() == []  # retrieval settings only: the ingested collection, nothing built
    n = len(qset.questions)
    assert len(df) == 2 * n
    assert list(df["config"].unique()) == ["dense, k=5", "keyword, k=3"]
    for column in ("first_relevant_rank", "recall@1", "recall@5", "mrr", "ndcg@5", "leaks", "embed_ms",
                   "search_ms", "keyword_ms", "total_ms"):
        assert column in df
    assert df["leaks"].sum() == 0
    assert_no_leaks(df)
    # recall@5 is undefined for k=3 (not zero), and the keyword leg never embeds
    assert df.loc[df["k"] == 3, "recall@5"].isna().all()
    assert df.loc[df["mode"] == "keyword", "embed_ms"].isna().all()
    # the sample set's seven questions for askers who may read no answer source
    assert df.groupby("config")["should_refuse"].sum().tolist() == [7, 7]
    # the same numbers as retrieval.evaluate, which reads the labels alone (here they agree with the ACLs)
    old = evaluate(lab_rag, load_questions(EXAMPLES / "questions.jsonl"), lab_copy, mode="dense", k=5,
                   rerank=False).summary()
    summary = summarize(df)
    assert summary.loc["dense, k=5", "recall@5"] == pytest.approx(old["recall@5"], abs=1e-4)
    assert summary.loc["dense, k=5", "mrr"] == pytest.approx(old["mrr@5"], abs=1e-4)
    assert summary.loc["dense, k=5", "answerable"] == old["questions"]
    # one line per configuration, each only over the k it has; one bar segment per stage that ran
    recall = plot_recall(df).axes[0]
    assert [line.get_label() for line in recall.lines] == ["dense, k=5", "keyword, k=3"]
    assert list(recall.lines[1].get_xdata()) == [1, 3]
    assert list(recall.lines[0].get_ydata())[-1] == pytest.approx(summary.loc["dense, k=5", "recall@5"], abs=1e-4)
    latency = plot_latency(df).axes[0]
    assert {c.get_label() for c in latency.containers} == {"embed", "search", "keyword", "fetch"}


def test_stored_acls_decide_what_counts(small, tmp_path):
    rag, root = small
    bob = Question("r", RESERVATION, "bob", ("imaging",), sources=("imaging/gpu-reservation.txt",))
    typo = Question("t", "How much space do I get in my home directory?", "dave",
                    sources=("public/storage-quotas.txt", "public/no-such-file.txt"))
    exp = Experiment(rag, root=root)
    before = exp.run([bob, typo], Config(rerank=False)).set_index("question_id")
    assert (before.loc["r", "relevant"], before.loc["r", "should_refuse"]) == (1, False)
    assert before.loc["r", "first_relevant_rank"] == 1
    # a label that matches no stored document: reported, and counted as unreadable (fail closed)
    assert (before.loc["t", "relevant"], before.loc["t", "unknown_labels"]) == (1, 1)
    # The imaging area is narrowed to the admins and re-ingested (an ACL change, no re-embedding):
    # the label still says bob's answer is there, the store says he may not read it.
    sidecar = root / "imaging" / ".rag-acl.toml"
    original = sidecar.read_text()
    try:
        sidecar.write_text('allow = ["group:hpc-admins"]\n')
        assert rag.ingest([root], progress=False).acl_updated == 2
        after = exp.run([bob], Config(rerank=False)).iloc[0]
    finally:
        sidecar.write_text(original)
        rag.ingest([root], progress=False)
    assert (after["relevant"], after["unreadable_relevant"], after["should_refuse"]) == (0, 1, True)
    assert math.isnan(after["recall@5"]) and math.isnan(after["mrr"])  # not a miss
    assert after["leaks"] == 0 and "imaging/gpu-reservation.txt" not in after["retrieved"]


def test_a_forbidden_source_in_the_results_is_a_leak(small):
    rag, root = small
    # The label says dave must never see the quota page; it is public, so retrieval returns it.
    q = Question("f", "How much space do I get in my home directory?", "dave",
                 sources=("public/cluster-user-guide.md",), forbidden=("public/storage-quotas.txt",))
    df = Experiment(rag, root=root).run([q], Config(rerank=False, mode="keyword"))
    assert df.loc[0, "leaks"] >= 1 and "public/storage-quotas.txt" in df.loc[0, "leaked_sources"]
    assert summarize(df).loc["keyword, k=5", "leaks"] >= 1
    with pytest.raises(AssertionError, match="dave asked .* public/storage-quotas.txt"):
        assert_no_leaks(df)


def test_index_variants_are_built_once_and_reuse_embeddings(small):
    rag, root = small
    questions = [Question("r", RESERVATION, "bob", ("imaging",), sources=("imaging/gpu-reservation.txt",))]
    configs = [Config(rerank=False), Config(rerank=False, mode="keyword", k=3), Config(rerank=False, store="memory"),
               Config(rerank=False, chunk_max_tokens=64, chunk_overlap_tokens=8),
               Config(rerank=False, mode="dense", chunk_max_tokens=64, chunk_overlap_tokens=8)]
    with Experiment(rag, root=root) as exp:
        df = exp.run(questions, configs)
        builds = {b["how"]: b for b in exp.builds()}
        assert len(exp.builds()) == 2  # one per build spec: two configurations share the small chunks
    # another store, same chunks: copied from the collection, nothing embedded
    assert (builds["copied"]["changes"], builds["copied"]["chunks_embedded"]) == ({"store": "memory"}, 0)
    assert builds["copied"]["documents_written"] == 4
    assert builds["ingested"]["chunks_embedded"] > 0
    rows = df.set_index("config")
    assert rows.loc["hybrid, k=5, store=memory", "retrieved"] == rows.loc["hybrid, k=5", "retrieved"]
    assert rows.loc["hybrid, k=5, store=memory", "store"] == "memory"
    assert rows.loc["hybrid, k=5, chunks=64/8", "chunk_max_tokens"] == 64
    base_docs = rag.collection().stats()["documents"]
    # A later session finds the variants on disk, by their build spec: nothing written or embedded again.
    with Experiment(rag, root=root) as again:
        again.run(questions, configs[2:4])
        assert [(b["documents_written"], b["chunks_embedded"]) for b in again.builds()] == [(0, 0), (0, 0)]
    assert rag.collection().stats()["documents"] == base_docs  # the Rag's own collection is untouched


def test_a_beir_folder_is_ingested_into_its_own_collection(small, tmp_path):
    rag, _ = small
    folder = make_beir(tmp_path / "tiny-beir")
    before = rag.collection().stats()
    df = Experiment(rag).run(folder, [Config(rerank=False, mode="keyword", k=3)])
    assert "beir-tiny-beir" in rag.collection_names()
    assert rag.collection().stats() == before
    rows = df.set_index("question_id")
    assert rows.loc["q2", "retrieved"][0] == "corpus.jsonl#d2"
    assert rows.loc["q2", "recall@3"] == 1.0 and rows.loc["q2", "ndcg@3"] == 1.0
    assert rows.loc["q1", "relevant"] == 2 and df["leaks"].sum() == 0


@pytest.mark.slow  # answers two questions end to end
def test_answer_metrics_with_generation(lab_rag, lab_copy):
    qset = read_questions(EXAMPLES / "questions.jsonl")
    freezer_bob = next(q for q in qset.questions if q.user == "bob" and "freezer" in q.text)
    open_day = next(q for q in qset.questions if q.user == "dave" and "open lab day" in q.text)
    df = Experiment(lab_rag, root=lab_copy).run([freezer_bob, open_day], Config(candidates=10), generate=True)
    refusal, answered = df.iloc[0], df.iloc[1]
    # nothing bob may read is about the freezer: the pipeline says so, no generation
    assert (refusal["should_refuse"], refusal["refusal"], refusal["refusal_correct"]) == (True, "correct refusal", True)
    assert math.isnan(refusal["generate_ms"])
    assert not answered["should_refuse"]
    assert answered["refusal"] in ("answered", "false refusal")
    assert answered["markers"] == len(cited_numbers(answered["answer"]))
    # The packaged 135M generator answers by extraction (answer_mode "auto"): a quote with its marker.
    assert lab_rag.answer_mode == "extract" and math.isnan(answered["generate_ms"])
    assert answered["markers"] >= 1 and answered["citation_precision"] == 1.0 and answered["expected_found"]
    summary = summarize(df)
    assert summary.iloc[0]["correct_refusals"] == 1 and summary.iloc[0]["wrong_answers"] == 0


@pytest.mark.slow
def test_readme_example(tmp_path, model_cache, monkeypatch):
    """README "Experiments" runs as written from the repository root (here a directory linking the examples)."""
    from tests.rag.test_readme import readme_blocks, run_block

    (block,) = [b for b in readme_blocks() if b.lang == "python" and "from rag.experiments import" in b.code]
    (tmp_path / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    (tmp_path / "my-index").mkdir(mode=0o700)
    (tmp_path / "my-index" / "models").symlink_to(model_cache, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    ns = run_block(block, {})
    df = ns["df"]
    assert df["config"].nunique() == 4 and len(df) == 4 * len(read_questions(EXAMPLES / "questions.jsonl").questions)
    assert df["leaks"].sum() == 0 and (tmp_path / "recall.png").stat().st_size > 0
    ns["rag"].close()


def test_a_pgvector_variant_is_copied_from_the_embedded_collection(small, rag_factory, tmp_path, pg_dsn):
    _, root = small
    rag = rag_factory(tmp_path / "home", dsn=pg_dsn)  # embedded store; the server only for the variant
    try:
        assert rag.ingest([root], progress=False).ok
        questions = [Question("r", RESERVATION, "bob", ("imaging",), sources=("imaging/gpu-reservation.txt",)),
                     Question("q", "How much space do I get in my home directory?", "dave",
                              sources=("public/storage-quotas.txt",))]
        with Experiment(rag, root=root) as exp:
            df = exp.run(questions, [Config(mode="dense", rerank=False), Config(mode="dense", rerank=False,
                                                                                store="pgvector")])
            (build,) = exp.builds()
        assert (build["how"], build["chunks_embedded"], build["documents_written"]) == ("copied", 0, 4)
        embedded, pg = df[df["store"] == "faiss"], df[df["store"] == "pgvector"]
        assert pg["retrieved"].tolist() == embedded["retrieved"].tolist()  # same vectors, exact search
        assert pg["leaks"].sum() == 0
        # the variant is a collection of its own on the server, never the Rag's collection name
        names = _pg_collection_names(pg_dsn)
        assert any(n.startswith("exp-") for n in names) and "default" not in names
    finally:
        rag.close()


def _pg_collection_names(dsn: str) -> list[str]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT name FROM rag_collections")]
