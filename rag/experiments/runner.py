"""Run a labelled question set over configurations: one tidy row per question x configuration.

    exp = Experiment(rag, root="examples/lab-docs")
    df = exp.run(read_questions("examples/questions.jsonl"), [Config(mode="dense", rerank=False), Config()])
    summarize(df)

Every question is asked as its own principal through `Rag.query`, the path users take, so
the ACL filter and post-check are the real ones. Ground truth comes from the stored ACLs
(`rag.experiments.ground_truth`); leaks are counted per row and `assert_no_leaks` fails on any.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag.errors import ConfigError
from rag.experiments.answer_metrics import score_answer
from rag.experiments.configs import Config
from rag.experiments.ground_truth import StoredAcls, label_of
from rag.experiments.metrics import first_relevant_rank, ndcg_at, recall_at, reciprocal_rank
from rag.experiments.progress import QuestionProgress
from rag.experiments.questions import Question, QuestionSet, read_questions
from rag.experiments.variants import IndexVariants

if TYPE_CHECKING:
    import pandas as pd

    from rag.pipeline import Rag

DEFAULT_KS = (1, 3, 5, 10)
# Stages of a query's timings, in pipeline order; model loads are timed apart and left out.
STAGES = ("embed", "search", "keyword", "fetch", "feedback", "rerank", "queue", "generate")

Questions = QuestionSet | Sequence[Question] | str | Path


class Experiment:
    """Question sets over configurations on one Rag; index variants are built once and kept.

    Args:
        rag: the Rag whose collection the default configuration queries.
        root: the corpus root the labels are relative to (the directory you ingested).
        corpus: what to ingest for configurations that need their own index (default: [root]).
        collection: the Rag's collection to query (default: its settings').
        cache_dir: where variant indexes live (default: HOME/experiments).
        progress: None: bars in a terminal or a notebook, none in logs; True/False: on/off.
    """

    def __init__(self, rag: Rag, root: str | Path | None = None, corpus: Sequence[str | Path] | None = None,
                 collection: str | None = None, cache_dir: str | Path | None = None,
                 progress: bool | None = None) -> None:
        self.rag = rag
        self.root = Path(root) if root is not None else None
        self.corpus = list(corpus) if corpus is not None else ([self.root] if self.root is not None else [])
        self.collection = collection or rag.settings.collection
        self.cache_dir = cache_dir
        self.progress = progress
        self._variants: dict[str, IndexVariants] = {}  # by the collection they derive from

    def __enter__(self) -> Experiment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the variant indexes' Rags (their data directories stay, for the next run)."""
        for variants in self._variants.values():
            variants.close()
        self._variants.clear()

    def builds(self) -> list[dict]:
        """What building each variant index did: copied (no embedding) or ingested, and counts."""
        return [b for v in self._variants.values() for b in v.builds]

    def run(self, questions: Questions, configs: Sequence[Config] | Config | None = None, *,
            generate: bool = False, ks: Sequence[int] = DEFAULT_KS) -> pd.DataFrame:
        """Ask every question under every configuration; one row each.

        Args:
            questions: a QuestionSet, a list of Questions, or a path (JSONL file or BEIR folder).
            configs: one or more Configs (default: Config(), the settings' hybrid + rerank).
            generate: also generate answers and score them (citation precision, expected fact,
                refusals); slow on a CPU, so off by default.
            ks: the k of the recall@k and nDCG@k columns (those above a configuration's k are NaN).

        Raises:
            ConfigError: no root to resolve labels against, a bad configuration, an unknown collection.
        """
        import pandas as pd

        qset = as_question_set(questions)
        configs = [configs] if isinstance(configs, Config) else list(configs or [Config()])
        if not configs or not qset.questions:
            raise ConfigError("nothing to run: give at least one question and one configuration")
        root, variants = self._corpus_for(qset)
        if any(c.rerank for c in configs):
            self.rag.reranker  # noqa: B018 - loaded once here, so that every variant shares it
        # Every index first: building one shows its own ingest bars, which cannot run inside ours.
        targets = [variants.for_config(c) for c in configs]
        variants.share_loaded_models()
        rows: list[dict[str, Any]] = []
        total = len(configs) * len(qset.questions)
        with QuestionProgress(self.progress) as bar:
            for config, (rag, name) in zip(configs, targets, strict=True):
                acls = self._stored_acls(rag, name, root)
                for q in qset.questions:
                    rows.append(self._row(rag, name, root, acls, config, q, generate, ks))
                    bar.update(len(rows), total)
        df = pd.DataFrame(rows)
        df["first_relevant_rank"] = df["first_relevant_rank"].astype("Int64")
        return df

    def _corpus_for(self, qset: QuestionSet) -> tuple[Path, IndexVariants]:
        """The labels' root and the variants of the collection the set is asked against."""
        if qset.corpus is not None and self.root is None:  # a BEIR set: its own collection
            from rag.experiments.beir import ingest_beir

            root, collection = ingest_beir(self.rag, qset, progress=self.progress)
            corpus: list[str | Path] = [root / "corpus.jsonl"]
        elif self.root is None:
            raise ConfigError("labels are paths under the corpus you ingested: pass root=... (that directory)")
        else:
            root, collection, corpus = self.root, self.collection, self.corpus
        if collection not in self._variants:
            self._variants[collection] = IndexVariants(self.rag, corpus, collection, self.cache_dir, self.progress)
        return root, self._variants[collection]

    def _stored_acls(self, rag: Rag, name: str, root: Path) -> StoredAcls:
        # Read again for every run: ACLs change without re-embedding (a sidecar edit and an ingest).
        store = rag.collection(name)
        store.refresh()
        return StoredAcls(store.document_states(), root)

    def _row(self, rag: Rag, name: str, root: Path, acls: StoredAcls, config: Config, q: Question,
             generate: bool, ks: Sequence[int]) -> dict[str, Any]:
        truth = acls.truth(q)
        candidates = config.candidates if config.candidates is not None else rag.settings.candidates
        # Retrieval settings go with this query only: the Rag's settings (and index) stay as they are.
        answer = rag.query(q.text, q.principal, collection=name, k=config.k, generate=generate,
                           rerank=config.rerank, mode=config.mode, candidates=candidates,
                           max_hits_per_document=config.max_hits_per_document,
                           dense_feedback=config.dense_feedback, page_evidence=config.page_evidence)
        ranked = [label_of(h.document_key, root) for h in answer.hits]
        relevant = truth.relevant
        grades = {s: q.grade(s) for s in relevant}
        leaked = acls.leaks(q, answer.hits)
        rank = first_relevant_rank(ranked, relevant) if relevant else None
        settings = rag.settings
        row: dict[str, Any] = {
            "config": config.label, "question_id": q.id, "question": q.text, "user": q.user,
            "groups": ",".join(q.groups), "mode": config.mode, "rerank": config.rerank, "k": config.k,
            # hits fetched per leg: the candidates for the reranker, else just k
            "candidates": max(config.k, candidates) if config.rerank else config.k,
            # the values in effect (the feedback leg runs in hybrid mode only)
            "dense_feedback": (settings.dense_feedback if config.dense_feedback is None else config.dense_feedback)
            and config.mode == "hybrid",
            "max_hits_per_document": (settings.max_hits_per_document if config.max_hits_per_document is None
                                      else config.max_hits_per_document),
            "page_evidence": settings.page_evidence if config.page_evidence is None else config.page_evidence,
            "chunk_max_tokens": settings.chunk_max_tokens,
            "chunk_overlap_tokens": settings.chunk_overlap_tokens, "embedder": settings.embedder or "(default)",
            "store": settings.store, "relevant": len(relevant), "unreadable_relevant": len(truth.unreadable),
            "unknown_labels": len(truth.unknown), "should_refuse": truth.should_refuse,
            "first_relevant_rank": rank,
        }
        for j in ks:
            row[f"recall@{j}"] = recall_at(ranked, relevant, j) if j <= config.k else math.nan
        row["mrr"] = reciprocal_rank(ranked, relevant)
        for j in ks:
            row[f"ndcg@{j}"] = ndcg_at(ranked, grades, j) if j <= config.k else math.nan
        row["leaks"] = len(leaked)
        row["leaked_sources"] = leaked
        row["retrieved"] = ranked
        timings = answer.timings
        for stage in STAGES:
            row[f"{stage}_ms"] = timings[stage] * 1000 if stage in timings else math.nan
        row["ttft_ms"] = timings["ttft"] * 1000 if "ttft" in timings else math.nan  # inside generate
        loads = sum(v for k, v in timings.items() if k.startswith("load_"))
        row["total_ms"] = (timings.get("total", 0.0) - loads) * 1000
        if generate:
            labels = [label_of(c.document_key, root) for c in answer.citations]
            score = score_answer(answer.text, answer.citations, labels, relevant, q.expected, truth.should_refuse)
            row |= {"answer": answer.text, "refused": score.refused, "refusal": score.refusal,
                    "refusal_correct": score.refusal_correct, "markers": score.markers,
                    "citation_precision": score.citation_precision, "expected_found": score.expected_found}
        return row


def as_question_set(questions: Questions) -> QuestionSet:
    if isinstance(questions, QuestionSet):
        return questions
    if isinstance(questions, str | Path):
        return read_questions(questions)
    return QuestionSet(list(questions), "questions")


def run_experiment(rag: Rag, questions: Questions, configs: Sequence[Config] | Config | None = None, *,
                   root: str | Path | None = None, corpus: Sequence[str | Path] | None = None,
                   collection: str | None = None, generate: bool = False, ks: Sequence[int] = DEFAULT_KS,
                   progress: bool | None = None) -> pd.DataFrame:
    """One call: `Experiment(rag, root, corpus, collection).run(questions, configs)`; variants are kept on disk."""
    with Experiment(rag, root, corpus, collection, progress=progress) as exp:
        return exp.run(questions, configs, generate=generate, ks=ks)
