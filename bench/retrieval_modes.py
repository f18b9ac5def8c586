"""Dense vs keyword vs hybrid retrieval on the sample corpus's labelled questions.

    PYTHONPATH=. .venv/bin/python bench/retrieval_modes.py [--home DIR] [--no-rerank]

Ingests examples/lab-docs into a temporary data directory (or uses --home), then asks
every question of examples/questions.jsonl and examples/keyword-questions.jsonl as its user
in each mode, retrieval only, and prints hit@5, recall@5 and MRR@5 per set and mode. The
hybrid mode is the default only while it does at least as well as dense here.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rag.pipeline import Rag  # noqa: E402
from rag.settings import load_settings  # noqa: E402
from retrieval.evaluate import evaluate, load_questions  # noqa: E402

SETS = {"questions.jsonl": "general", "keyword-questions.jsonl": "keyword"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, help="data directory (default: a fresh temporary one)")
    parser.add_argument("--no-rerank", action="store_true", help="score the fused legs without the cross-encoder")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    root = REPO / "examples" / "lab-docs"
    rag = Rag(load_settings(home=args.home or Path(tempfile.mkdtemp(prefix="rag-modes-"))))
    if not rag.collection_names():
        rag.ingest([root])
    rerank = not args.no_rerank
    print(f"# retrieval modes on the sample corpus, k={args.k}, rerank={rerank}, {datetime.date.today()}")
    print(f"| questions | mode | n | hit@{args.k} | recall@{args.k} | MRR@{args.k} | forbidden seen | s/question |")
    print("|---|---|---|---|---|---|---|---|")
    for file, label in SETS.items():
        questions = load_questions(REPO / "examples" / file)
        for mode in ("dense", "keyword", "hybrid"):
            t = time.perf_counter()
            s = evaluate(rag, questions, root, mode=mode, k=args.k, rerank=rerank).summary()
            per = (time.perf_counter() - t) / len(questions)
            print(f"| {label} | {mode} | {s['questions']} | {s[f'hit@{args.k}']:.3f} | {s[f'recall@{args.k}']:.3f} "
                  f"| {s[f'mrr@{args.k}']:.3f} | {s['forbidden']} | {per:.2f} |")


if __name__ == "__main__":
    main()
