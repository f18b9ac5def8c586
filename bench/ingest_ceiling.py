"""How close the CPU stages of `rag ingest` let a run come to its embedder: an embedder that costs no CPU.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python bench/ingest_ceiling.py --embedder .gpu-carry/minilm

`rag ingest` (in process, `--store memory`, 4,096-chunk batches as on a GPU, the overlap on) over
bench/ingest_gpu.py's JSONL records, with the embedder's `embed` replaced by one that sleeps
`--ms-per-chunk` per chunk with the GIL released (default 0.255 ms: the packaged MiniLM's rate on an
H100, 3,921 chunks/s) and returns random unit vectors. The peer is that embedder alone (its sleeps,
measured in the same run); the ratio is the ceiling the scan, parse, chunk and write stages leave on
this machine's CPU when the embedder takes none of it. A real GPU embedder also needs the GIL for its
launches (bench/ingest_gpu.py measures that on the GPU node); the model here only supplies the
tokenizer, the chunking and the vector size. `--write-behind true false` runs each with the store
writes on a writer thread of their own and on the ingest thread, in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest_gpu import make_corpus  # noqa: E402


def run(records: int, ms_per_chunk: float, overlap: bool, embedder: str,
        write_behind: bool = True, switch_ms: float | None = None) -> tuple[dict[str, float], float]:
    """(the run's stage seconds, the sleeping embedder's own seconds)."""
    from rag.pipeline import Rag
    from rag.settings import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus" / "records.jsonl"
        corpus.parent.mkdir()
        make_corpus(corpus, records)
        settings = load_settings(home=str(Path(tmp) / "home"), store="memory", ingest_batch_chunks=4096,
                                 ingest_overlap_embedding=overlap, ingest_write_behind=write_behind,
                                 embedder=str(Path(embedder).resolve()),
                                 **({} if switch_ms is None else {"ingest_switch_interval_ms": switch_ms}))
        rag = Rag(settings)
        model = rag.embedder
        slept = 0.0

        def embed(texts):
            nonlocal slept
            seconds = len(texts) * ms_per_chunk / 1e3
            time.sleep(seconds)
            slept += seconds
            v = np.random.default_rng(len(texts)).standard_normal((len(texts), model.dim)).astype(np.float32)
            return v / np.linalg.norm(v, axis=1, keepdims=True)

        model.embed = embed
        report = rag.ingest([corpus.parent], progress=False)
        rag.close()
        return report.seconds, slept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embedder", required=True, help="a local encoder folder (tokenizer, vector size)")
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--ms-per-chunk", type=float, default=0.255)
    ap.add_argument("--overlap", nargs="+", choices=["true", "false"], default=["true"])
    ap.add_argument("--write-behind", nargs="+", choices=["true", "false"], default=["true"],
                    help="store writes on a writer thread of their own (true, the default) or on the ingest thread")
    ap.add_argument("--switch-ms", nargs="+", type=float, default=[None],
                    help="ingest_switch_interval_ms values to run (0: the interpreter's 5 ms; default 0.1)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"# {datetime.date.today()}; {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} usable CPUs; {args.records} records; embedder sleeping "
          f"{args.ms_per_chunk} ms a chunk; code from {Path(__file__).resolve().parents[1]}")
    print("| overlap | write behind | GIL switch ms | round | stages, s | total s | embedder alone s | total / alone |")
    print("|---|---|---|---|---|---|---|---|")
    settings = [(o, w, m) for o in args.overlap for w in args.write_behind for m in args.switch_ms]
    for r in range(1, args.rounds + 1):  # rounds outermost: each setting again in turn
        for overlap, write_behind, switch_ms in settings:
            seconds, alone = run(args.records, args.ms_per_chunk, overlap == "true", args.embedder,
                                 write_behind == "true", switch_ms)
            stages = json.dumps({k: round(v, 2) for k, v in seconds.items() if k != "total"})
            print(f"| {overlap} | {write_behind} | {'default' if switch_ms is None else switch_ms} | {r} | {stages} "
                  f"| {seconds['total']:.2f} | {alone:.2f} | {alone / seconds['total']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
