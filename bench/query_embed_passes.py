"""What one forward pass per question costs the query embedder on a CPU, against batching them.

    PYTHONPATH=. .venv/bin/python bench/query_embed_passes.py [--questions 16] [--repeats 5]

On a CPU the service embeds each question in a pass of its own (`BatchedQueryEmbedder`,
one_per_pass), so that no user's vector depends on another user's text. This times N concurrent
questions (the PostgreSQL set's first N, queued into one batch with `many`) both ways, and
prints how far a batched vector is from the same question's vector alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe_machine  # noqa: E402

from ingest.embed.embedder import Embedder, EmbedderConfig  # noqa: E402
from rag.batching import BatchedQueryEmbedder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = REPO / "examples" / "eval" / "postgresql" / "questions.jsonl"
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]
    questions = questions[: args.questions]
    embedder = Embedder(EmbedderConfig(device="cpu"))
    print(f"# query embedding, {len(questions)} questions in one batch, {datetime.date.today()}, "
          f"{describe_machine(False)}")
    medians = {}
    vectors = {}
    for one in (False, True):
        batched = BatchedQueryEmbedder(embedder.embed, one_per_pass=one)
        times = []
        try:
            for _ in range(args.repeats + 1):  # the first call warms up
                t = time.perf_counter()
                vectors[one] = batched.many(questions)
                times.append(time.perf_counter() - t)
        finally:
            batched.close()
        medians[one] = statistics.median(times[1:]) * 1e3
    alone = np.stack([embedder.embed([q])[0] for q in questions])
    print("| mode | ms for the batch | vs batched | max |diff| from each question alone |")
    print("|---|---|---|---|")
    for one, label in ((False, "batched (the peer; GPUs)"), (True, "one pass per question (CPUs)")):
        diff = float(np.abs(vectors[one] - alone).max())
        print(f"| {label} | {medians[one]:.1f} | {medians[one] / medians[False]:.2f}x | {diff:.2e} |")
    embedder.close()


if __name__ == "__main__":
    main()
