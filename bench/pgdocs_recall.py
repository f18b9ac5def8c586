"""Recall@5 and MRR by source page on the PostgreSQL 15 manual, per retrieval mode, with leak counts.

    nice -n 19 .venv/bin/python bench/pgdocs_recall.py [--home DIR] [--corpus DIR] [--subset N]

Builds the corpus of examples/eval/postgresql/ (Debian's postgresql-doc-15 manual, one folder
per part, each with its ACL sidecar), ingests it with the packaged models (`Rag.ingest`, an
incremental ingest: re-running with the same --home only re-reads changed pages), then asks
every labelled question as its user in four configurations: dense, keyword, hybrid (no
reranker) and hybrid + rerank. A question's relevant pages are those of its `sources` that
the asker may read under the corpus's sidecars; a question with none is a "should refuse"
question and only counts for leaks. A leak is any hit from a page the asker may not read
(must be 0). The dense row is the peer: the other rows also print their recall as a ratio
of its recall.

Two diagnostic columns come from a longer list of `candidates` hits per question: recall of
the first k distinct pages (what a cap of one chunk per page in the top k would give) and
recall of every page in it (the ceiling the reranker works under). s/question is the wall
time of a configuration's calls per question (without the reranker, two calls).

--subset N ingests only the pages the questions name plus N other pages (every k-th of the
manual) for a quick run; the full manual takes minutes on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "examples" / "eval" / "postgresql"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(EVAL_DIR))
sys.path.insert(0, str(REPO / "bench"))

from build_corpus import MANUAL, build_corpus, page_folders  # noqa: E402
from machine import describe_machine  # noqa: E402

from permissions.models import Principal  # noqa: E402
from permissions.sources import AclResolver  # noqa: E402
from rag.pipeline import Rag  # noqa: E402
from rag.settings import load_settings  # noqa: E402
from retrieval.evaluate import source_key  # noqa: E402

# (label, retrieval mode, rerank, candidates: None = the settings' value)
CONFIGS = (("dense", "dense", False, None), ("keyword", "keyword", False, None), ("hybrid", "hybrid", False, None),
           ("hybrid + rerank", "hybrid", True, None), ("hybrid + rerank, 50 candidates", "hybrid", True, 50))


@dataclass(frozen=True)
class Question:
    question: str
    principal: Principal
    sources: tuple[str, ...]  # every page with the answer, readable or not
    expected: str


@dataclass
class ConfigScore:
    """Per-configuration totals; recall and MRR over answerable questions only."""

    recalls: list[float] = field(default_factory=list)
    reciprocal_ranks: list[float] = field(default_factory=list)
    # Diagnostics from a longer list of `candidates` hits: the first k *distinct* pages (what a
    # per-page cap in the top k would give), and every page of it (the ceiling for reranking).
    distinct_recalls: list[float] = field(default_factory=list)
    deep_recalls: list[float] = field(default_factory=list)
    leaks: list[tuple[str, str, str]] = field(default_factory=list)  # (question, user, page)
    misses: list[tuple[Question, list[str]]] = field(default_factory=list)  # recall < 1: the top pages
    seconds: float = 0.0


def load(path: Path) -> list[Question]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            out.append(Question(q["question"], Principal(q["user"], frozenset(q.get("groups", ()))),
                                tuple(q["sources"]), q.get("expected", "")))
    return out


def subset_pages(questions: list[Question], distractors: int) -> list[str]:
    """The pages the questions name, plus `distractors` others spread evenly over the manual."""
    named = {s.rpartition("/")[2] for q in questions for s in q.sources}
    others = [p for p in sorted(page_folders()) if p not in named]
    step = max(1, len(others) // distractors) if distractors else 0
    return sorted(named | set(others[::step][:distractors] if step else ()))


def page_acls(corpus: Path) -> dict[str, frozenset[str]]:
    """Each page's ACL, resolved from the sidecars the way ingest resolves it."""
    resolver = AclResolver(corpus)
    return {str(p.relative_to(corpus)): resolver.resolve(p)[0] for p in sorted(corpus.rglob("*.html"))}


def score(rag: Rag, questions: list[Question], corpus: Path, acls: dict[str, frozenset[str]],
          mode: str, rerank: bool, k: int, candidates: int) -> ConfigScore:
    retriever = rag.retriever(rerank=rerank)
    result = ConfigScore()
    deep_k = max(k, candidates)
    t = time.perf_counter()

    def pages_of(q: Question, n: int) -> list[str]:
        hits = retriever.retrieve(q.question, q.principal, k=n, candidates=candidates, rerank=rerank, mode=mode).hits
        return [source_key(h.document_key, corpus) for h in hits]

    for q in questions:
        deep = pages_of(q, deep_k)
        # The top k is asked for as such: it is not a prefix of the longer list (without the
        # reranker each leg fetches only k; with a cap, a longer list may search deeper, and
        # the deeper candidates add to the evidence of the pages already found).
        pages = pages_of(q, k)
        for page in set(pages + deep):
            # An unknown page (not in the corpus's ACL map) counts as a leak too: fail closed.
            if not q.principal.can_read(acls.get(page, frozenset())):
                result.leaks.append((q.question, q.principal.user, page))
        relevant = {s for s in q.sources if q.principal.can_read(acls.get(s, frozenset()))}
        if not relevant:
            continue  # should refuse: nothing readable answers it
        found = relevant.intersection(pages)
        result.recalls.append(len(found) / len(relevant))
        result.distinct_recalls.append(len(relevant.intersection(list(dict.fromkeys(deep))[:k])) / len(relevant))
        result.deep_recalls.append(len(relevant.intersection(deep)) / len(relevant))
        first = next((i for i, p in enumerate(pages) if p in relevant), None)
        result.reciprocal_ranks.append(0.0 if first is None else 1.0 / (first + 1))
        if len(found) < len(relevant):
            result.misses.append((q, pages))
    result.seconds = time.perf_counter() - t
    return result


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, help="data directory (default: a fresh temporary one); "
                        "reuse one to skip re-embedding unchanged pages")
    parser.add_argument("--corpus", type=Path,
                        help="corpus directory to build into (default: HOME-corpus, next to --home)")
    parser.add_argument("--source", type=Path, default=MANUAL, help=f"the manual's HTML folder (default {MANUAL})")
    parser.add_argument("--questions", type=Path, default=EVAL_DIR / "questions.jsonl",
                        help="labelled questions (default: the set next to the corpus builder)")
    parser.add_argument("--subset", type=int, metavar="N",
                        help="ingest only the questions' pages plus N other pages (quick run)")
    parser.add_argument("--k", type=int, default=5, help="hits per question (default 5)")
    parser.add_argument("--configs", default=";".join(label for label, *_ in CONFIGS),
                        help="semicolon-separated configuration labels to run (labels hold commas; "
                        "default: all; the dense row is the ratio's peer, '-' without it)")
    parser.add_argument("--show-misses", action="store_true",
                        help="list each question hybrid + rerank does not fully find, with the pages it returned")
    args = parser.parse_args()
    chosen = [c.strip() for c in args.configs.split(";") if c.strip()]
    unknown = sorted(set(chosen) - {label for label, *_ in CONFIGS})
    if unknown:
        parser.error(f"unknown --configs {', '.join(unknown)}; choose from: {', '.join(c[0] for c in CONFIGS)}")

    base = None if args.home else Path(tempfile.mkdtemp(prefix="rag-pgdocs-"))
    home = args.home or base / "home"
    # Next to the data directory, not in it: the data directory holds only rag's own files.
    corpus = args.corpus or (base / "corpus" if base else home.with_name(home.name + "-corpus"))
    questions = load(args.questions)
    pages = subset_pages(questions, args.subset) if args.subset is not None else None
    try:
        placed = build_corpus(corpus, args.source, pages)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    acls = page_acls(corpus)
    rag = Rag(load_settings(home=home))
    t = time.perf_counter()
    report = rag.ingest([corpus], progress=False)
    ingest_s = time.perf_counter() - t
    stats = rag.retriever(rerank=False).store.stats()
    answerable = sum(1 for q in questions if any(q.principal.can_read(acls.get(s, frozenset())) for s in q.sources))

    print(f"# PostgreSQL 15 manual, recall@{args.k} by source page, {datetime.date.today()}, {describe_machine()}")
    print(f"corpus: {len(placed)} pages, {stats.get('documents')} documents, {stats.get('chunks')} chunks; "
          f"ingest {ingest_s:.0f} s ({report.added} added, {report.updated} updated, {report.unchanged} unchanged); "
          f"embedder {rag.embedder.name}, reranker {rag.settings.reranker or 'packaged default'}, "
          f"chunks of {rag.settings.chunk_max_tokens} tokens, candidates {rag.settings.candidates}, "
          f"dense feedback {'on' if rag.settings.dense_feedback else 'off'}")
    print(f"questions: {len(questions)} ({answerable} answerable, {len(questions) - answerable} should refuse)")
    print()
    print(f"| configuration | recall@{args.k} | vs dense | MRR@{args.k} | fully found "
          f"| recall@{args.k}, distinct pages | recall of all candidates | leaks | s/question |")
    print("|---|---|---|---|---|---|---|---|---|")
    scores = {}
    for label, mode, rerank, candidates in CONFIGS:
        if label not in chosen:
            continue
        candidates = candidates or rag.settings.candidates
        scores[label] = s = score(rag, questions, corpus, acls, mode, rerank, args.k, candidates)
        dense = mean(scores["dense"].recalls) if "dense" in scores else 0.0
        ratio = f"{mean(s.recalls) / dense:.2f}" if dense else "-"
        print(f"| {label} | {mean(s.recalls):.3f} | {ratio} | {mean(s.reciprocal_ranks):.3f} "
              f"| {len(s.recalls) - len(s.misses)}/{len(s.recalls)} | {mean(s.distinct_recalls):.3f} "
              f"| {mean(s.deep_recalls):.3f} ({candidates}) | {len(s.leaks)} | {s.seconds / len(questions):.2f} |",
              flush=True)
    for label, s in scores.items():
        for question, user, page in s.leaks:
            print(f"LEAK ({label}): {user} asked {question!r} and got {page}")
    if args.show_misses and "hybrid + rerank" in scores:
        print("\nnot fully found by hybrid + rerank:")
        for q, got in scores["hybrid + rerank"].misses:
            print(f"- {q.principal.user}: {q.question!r}\n    wanted {', '.join(q.sources)}"
                  f"\n    got    {', '.join(got)}")
    if any(s.leaks for s in scores.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
