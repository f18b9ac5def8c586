"""The evidence the answer floors decide on, per labelled question: for calibrating them.

For each question of a project JSONL set, asked as its user over an ingested data directory:
the best cross-encoder logits of a whole source and of a sentence (what `min_rerank_score`,
ExtractConfig.source_floor and ExtractConfig.floor compare against), and the embedder's best
cosine between the question and a sentence (a second opinion the floors do not use). Questions
that must be refused (no readable answer source) are marked, so a floor's margin can be read off.

    rag --home /tmp/h ingest examples/lab-docs
    python scripts/answer_floor_scores.py --home /tmp/h examples/questions.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from permissions.models import Principal
from rag.extractive import candidate_sentences, scoring_text
from rag.pipeline import Rag
from rag.prompts import canonical_order
from rag.settings import load_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("questions", type=Path, help="a project JSONL question set")
    parser.add_argument("--home", type=Path, required=True, help="the data directory it was ingested into")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    rag = Rag(load_settings(home=args.home, min_rerank_score=None))  # every hit, to see what a floor drops
    print("must_refuse  source_logit  sentence_logit  sentence_cosine  user  question")
    try:
        for line in args.questions.read_text().splitlines():
            if not line.strip():
                continue
            q = json.loads(line)
            principal = Principal(q["user"], frozenset(q.get("groups", [])))
            hits = rag.query(q["question"], principal, k=args.k, generate=False).hits
            sources = canonical_order(hits)
            sentences = candidate_sentences(sources)
            logits = rag.batched_reranker.batcher((q["question"], [scoring_text(s, sources) for s in sentences]))
            cosines = rag.embedder.embed([s.text for s in sentences]) @ rag.embedder.embed([q["question"]])[0]
            print(f"{not q['relevant']!s:11}  {max(h.score for h in hits):12.2f}  {max(logits):14.2f}  "
                  f"{float(np.max(cosines)):15.3f}  {q['user']:5} {q['question'][:60]}")
    finally:
        rag.close()


if __name__ == "__main__":
    main()
