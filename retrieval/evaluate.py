"""Retrieval experiments over labelled questions: hit rate, recall and MRR at k, per mode.

A labelled question (JSONL, one per line, see examples/questions.jsonl) names the user who
asks, their groups, the sources that answer it ("relevant", paths relative to the corpus
root) and sources that must never appear ("forbidden"). Usable from a notebook:

    from retrieval.evaluate import evaluate, load_questions
    report = evaluate(rag, load_questions("examples/questions.jsonl"), root="examples/lab-docs",
                      mode="hybrid", k=5)
    report.summary()   # {"questions": 39, "hit@5": 0.93, "recall@5": 0.81, "mrr@5": 0.77, "forbidden": 0}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from permissions.models import Principal


@dataclass(frozen=True)
class LabelledQuestion:
    question: str
    user: str
    groups: tuple[str, ...]
    relevant: tuple[str, ...]
    forbidden: tuple[str, ...] = ()


@dataclass
class EvalReport:
    k: int
    mode: str
    hits: list[float] = field(default_factory=list)
    recalls: list[float] = field(default_factory=list)
    reciprocal_ranks: list[float] = field(default_factory=list)
    forbidden_seen: list[tuple[str, str, str]] = field(default_factory=list)  # (question, user, source)
    misses: list[tuple[str, str]] = field(default_factory=list)  # answerable, nothing relevant found

    def summary(self) -> dict[str, Any]:
        n = len(self.hits)

        def mean(xs: list[float]) -> float:
            return round(sum(xs) / n, 4) if n else 0.0

        return {"mode": self.mode, "questions": n, f"hit@{self.k}": mean(self.hits),
                f"recall@{self.k}": mean(self.recalls), f"mrr@{self.k}": mean(self.reciprocal_ranks),
                "forbidden": len(self.forbidden_seen)}


def load_questions(*paths: str | Path) -> list[LabelledQuestion]:
    out = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                out.append(LabelledQuestion(q["question"], q["user"], tuple(q.get("groups", ())),
                                            tuple(q.get("relevant", ())), tuple(q.get("forbidden", ()))))
    return out


def source_key(document_key: str, root: Path) -> str:
    """A stored document key as the labels write it: relative path, plus '#record' for JSONL."""
    path, _, record = document_key.partition("#")
    try:
        rel = str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        rel = path
    return f"{rel}#{record}" if record else rel


def evaluate(rag: Any, questions: list[LabelledQuestion], root: str | Path, mode: str = "hybrid",
             k: int = 5, rerank: bool | None = None, collection: str | None = None) -> EvalReport:
    """Ask every question as its user (retrieval only) and score the sources that come back.

    A source counts as relevant if the label names the document, or the JSONL file it is a
    record of. Every hit is also checked against the label's forbidden list.
    """
    root = Path(root)
    report = EvalReport(k=k, mode=mode)
    for q in questions:
        answer = rag.query(q.question, Principal(q.user, frozenset(q.groups)), collection=collection,
                           k=k, generate=False, rerank=rerank, mode=mode)
        keys = [source_key(h.document_key, root) for h in answer.hits]
        for key in keys:
            if key in q.forbidden or key.partition("#")[0] in q.forbidden:
                report.forbidden_seen.append((q.question, q.user, key))
        if not q.relevant:
            continue
        relevant = set(q.relevant)
        ranks = [i for i, key in enumerate(keys) if key in relevant or key.partition("#")[0] in relevant]
        found = {keys[i] if keys[i] in relevant else keys[i].partition("#")[0] for i in ranks}
        report.hits.append(1.0 if ranks else 0.0)
        report.recalls.append(len(found) / len(relevant))
        report.reciprocal_ranks.append(1.0 / (ranks[0] + 1) if ranks else 0.0)
        if not ranks:
            report.misses.append((q.question, q.user))
    return report
