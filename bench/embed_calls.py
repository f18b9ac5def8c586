"""The embedder over one corpus in one call against calls of a few thousand texts, here and in a worker.

`rag ingest` embeds in calls of `ingest_batch_chunks` texts (4,096 on a GPU) so that embedding
overlaps reading; on an H100 its embed stage ran at about half the speed of one call over the
whole corpus (docs/benchmarks.md). This separates the call size from the rest of the pipeline:
the same texts (bench/ingest_gpu.py's records), the same model, embedded in consecutive calls of
each size, with the model in this process and in a worker process (`in_worker`, the ingest
default on a GPU). `--parent-load` also keeps this process busy during the timed calls the way
ingest's reading side is (a Python thread that never waits, and batch tokenization on the Rust
tokenizer's thread pool), to see whether a worker slows down beside it. Printed per setting:
chunks/s, its ratio to one call in this process, the first call's and the median call's
seconds, and for the worker the seconds it spent inside.

    PYTHONPATH=. python bench/embed_calls.py --embedder .gpu-carry/minilm --records 50000 --calls 0 16384 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest_gpu import make_corpus  # noqa: E402  (the ingest benchmark's records)

from ingest.embed.embedder import Embedder, EmbedderConfig  # noqa: E402


class ParentLoad:
    """Busy work in this process while the calls run: a pure-Python thread and batch tokenization."""

    def __init__(self, folder: str, texts: list[str]) -> None:
        import threading

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.texts = texts[:2048]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._python, daemon=True),
                        threading.Thread(target=self._tokenize, daemon=True)]
        self.loops = 0

    def _python(self) -> None:
        while not self.stop.is_set():
            sum(len(t.split()) for t in self.texts[:256])  # Python bytecode: holds the GIL
            self.loops += 1

    def _tokenize(self) -> None:
        while not self.stop.is_set():
            self.tokenizer(self.texts)

    def __enter__(self) -> ParentLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def timed_calls(embedder: Embedder, texts: list[str], size: int, sync) -> dict:
    """Embed `texts` in consecutive calls of `size` (0: one call); seconds overall and per call."""
    size = size or len(texts)
    calls = []
    worker_before = embedder.worker_seconds
    start = time.perf_counter()
    for lo in range(0, len(texts), size):
        t = time.perf_counter()
        embedder.embed(texts[lo:lo + size])
        sync()
        calls.append(time.perf_counter() - t)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "calls": len(calls), "first_s": calls[0], "median_s": statistics.median(calls),
            "worker_s": embedder.worker_seconds - worker_before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embedder", required=True, help="model folder")
    ap.add_argument("--records", type=int, default=50000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, nargs="+", default=[0, 16384, 4096], help="texts per call (0: all)")
    ap.add_argument("--where", nargs="+", default=["here", "worker"], choices=["here", "worker"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--parent-load", nargs="+", default=["off"], choices=["off", "on"],
                    help="also time each setting with this process kept busy (see above)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "records.jsonl"
        make_corpus(corpus, args.records)
        texts = [json.loads(line)["text"] for line in corpus.open()]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU"
    print(f"# {datetime.date.today()}; {name}; {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"{len(texts)} texts; {args.embedder}")
    print("| where | parent load | texts per call | round | seconds | chunks/s | vs one call here | calls "
          "| first call s | median call s | inside the worker s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    baseline = None
    for where in args.where:
        embedder = Embedder(EmbedderConfig(model=args.embedder, device=args.device, in_worker=where == "worker"))
        try:
            warm = texts[:2048]
            for _ in range(2):  # kernels, allocator, the worker's start
                embedder.embed(warm)
                sync()
            for round_ in range(1, args.rounds + 1):
                for size, load in [(size, load) for load in args.parent_load for size in args.calls]:
                    if load == "on":
                        with ParentLoad(args.embedder, texts):
                            r = timed_calls(embedder, texts, size, sync)
                    else:
                        r = timed_calls(embedder, texts, size, sync)
                    rate = len(texts) / r["seconds"]
                    if baseline is None and where == "here" and size == 0 and load == "off":
                        baseline = rate
                    ratio = f"{rate / baseline:.2f}x" if baseline else "-"
                    inside = f"{r['worker_s']:.2f}" if where == "worker" else "-"
                    print(f"| {where} | {load} | {size or 'all'} | {round_} | {r['seconds']:.2f} | {rate:,.0f} "
                          f"| {ratio} | {r['calls']} | {r['first_s']:.3f} | {r['median_s']:.3f} | {inside} |",
                          flush=True)
        finally:
            embedder.close()


if __name__ == "__main__":
    main()
