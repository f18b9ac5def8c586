"""The packaged cross-encoder's time per query, against sentence-transformers on the same model.

    PYTHONPATH=. .venv/bin/python bench/rerank_speed.py [--home DIR] [--candidates 20] [--device cpu]

Ingests examples/lab-docs into a temporary data directory (or uses --home), retrieves each
labelled question's candidates the way a query does (hybrid, no reranker), then times scoring
those (question, chunk) pairs — the reranker's whole job in a query — in several ways:

- sentence-transformers' CrossEncoder on the same converted folder (the peer: what a pipeline
  built on it gets; its default batch of 32, fp32);
- ours in fp32 and in bf16 in batches of 32 length-sorted pairs (the CPU default before), in fp32
  one pair per pass, and the default ("auto": bf16 where the CPU or GPU computes it natively, fp32
  elsewhere; one pair per pass on a CPU, so a pair's score depends on nothing scored beside it);
- onnxruntime on the packaged INT8 ONNX the folder was converted from (another peer).

Each row prints milliseconds per query, its speed-up over the peer, and how far its scores are
from fp32's (max |diff| in logits, and the share of queries whose top 5 keeps the same order).
Scores are the cross-encoder's logits, so a difference of a few hundredths is noise next to
the several logits that separate relevant from unrelated passages.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe_machine  # noqa: E402

from permissions.models import Principal  # noqa: E402
from rag.pipeline import Rag  # noqa: E402
from rag.settings import load_settings  # noqa: E402
from retrieval.evaluate import load_questions  # noqa: E402
from retrieval.rerank import CrossEncoderReranker, packaged_reranker_onnx, resolve_reranker_dir  # noqa: E402

Scorer = Callable[[str, list[str]], list[float]]


def time_scorer(score: Scorer, queries: list[tuple[str, list[str]]], repeats: int) -> tuple[float, list[np.ndarray]]:
    """Milliseconds per query (best of `repeats` passes over every query) and the scores."""
    score(*queries[0])  # warm-up: first-call allocations and kernel selection
    best = float("inf")
    scores: list[np.ndarray] = []
    for _ in range(repeats):
        t = time.perf_counter()
        scores = [np.asarray(score(q, passages), dtype=np.float64) for q, passages in queries]
        best = min(best, (time.perf_counter() - t) / len(queries))
    return best * 1000, scores


def onnx_scorer(tokenizer, threads: int) -> Scorer:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(packaged_reranker_onnx()), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def score(query: str, passages: list[str], batch: int = 8) -> list[float]:
        out = [0.0] * len(passages)
        order = sorted(range(len(passages)), key=lambda i: -len(passages[i]))
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            enc = tokenizer([query] * len(idx), [passages[i] for i in idx], padding=True,
                            truncation="longest_first", max_length=512, return_tensors="np")
            logits = session.run(None, {n: enc[n].astype(np.int64) for n in names})[0]
            for i, value in zip(idx, logits[:, 0].tolist(), strict=True):
                out[i] = value
        return out

    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, help="data directory (default: a fresh temporary one)")
    parser.add_argument("--candidates", type=int, default=20, help="pairs per query (default 20, the setting's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over every query; the best counts")
    parser.add_argument("--queries", type=int, default=32, help="labelled questions used (default 32 of 64)")
    args = parser.parse_args()
    import torch
    from sentence_transformers import CrossEncoder

    root = REPO / "examples" / "lab-docs"
    rag = Rag(load_settings(home=args.home or Path(tempfile.mkdtemp(prefix="rag-rerank-"))))
    if not rag.collection_names():
        rag.ingest([root], progress=False)
    retriever = rag.retriever(rerank=False)
    queries = []
    for q in load_questions(REPO / "examples" / "questions.jsonl", REPO / "examples" / "keyword-questions.jsonl"):
        hits = retriever.retrieve(q.question, Principal(q.user, frozenset(q.groups)), k=args.candidates,
                                  candidates=args.candidates, rerank=False).hits
        if hits:
            queries.append((q.question, [h.text for h in hits]))
    queries = queries[:args.queries]
    folder = resolve_reranker_dir(None, rag.settings.model_cache)
    reference = CrossEncoderReranker(folder, device=args.device, dtype="float32")
    lengths = [len(reference.tokenizer(q, p)["input_ids"]) for q, ps in queries for p in ps]

    rows: list[tuple[str, Scorer]] = []
    # Identity: its logits, like ours (by default it applies a sigmoid to a one-label model).
    peer = CrossEncoder(str(folder), device=args.device, max_length=512, activation_fn=torch.nn.Identity())
    rows.append(("sentence-transformers CrossEncoder (peer, batch 32, fp32)",
                 lambda q, ps: peer.predict([(q, p) for p in ps], show_progress_bar=False).tolist()))
    for label, kwargs in (("ours, fp32, batch 32 (before)", {"dtype": "float32", "batch_size": 32}),
                          ("ours, fp32, batch 1", {"dtype": "float32", "batch_size": 1}),
                          ("ours, bf16, batch 32", {"dtype": "bfloat16", "batch_size": 32}),
                          ("ours, default", {})):
        model = CrossEncoderReranker(folder, device=args.device, **kwargs)
        if label == "ours, default":
            label += f" ({model.dtype}, batch {model.batch_size})"
        rows.append((label, model.score))
    if args.device == "cpu":
        rows.append(("onnxruntime, packaged INT8 ONNX, batch 8",
                     onnx_scorer(reference.tokenizer, torch.get_num_threads())))

    fp32_scores = [np.asarray(reference.score(q, ps)) for q, ps in queries]
    machine = describe_machine(args.device.startswith("cuda"))
    print(f"# reranker time per query, {datetime.date.today()}, {machine}")
    print(f"{len(queries)} queries x {args.candidates} candidates from the sample corpus; pair tokens mean "
          f"{np.mean(lengths):.0f}, max {max(lengths)}; best of {args.repeats} passes")
    print()
    print("| scorer | ms / query | speed-up vs peer | max abs diff vs fp32 (logits) "
          "| same top-5 set | same top-5 order |")
    print("|---|---|---|---|---|---|")
    peer_ms = None
    for label, score in rows:
        ms, scores = time_scorer(score, queries, args.repeats)
        peer_ms = peer_ms or ms
        diff = max(float(np.abs(a - b).max()) for a, b in zip(scores, fp32_scores, strict=True))
        tops = [(list(np.argsort(-a, kind="stable")[:5]), list(np.argsort(-b, kind="stable")[:5]))
                for a, b in zip(scores, fp32_scores, strict=True)]
        same_set = np.mean([set(a) == set(b) for a, b in tops])
        same_order = np.mean([a == b for a, b in tops])
        print(f"| {label} | {ms:.0f} | {peer_ms / ms:.2f}x | {diff:.3f} | {same_set:.2f} | {same_order:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
