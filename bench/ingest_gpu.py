"""`rag ingest` itself on a GPU against the embedder alone, with the tokenizer's threads on and off.

    PYTHONPATH=. python bench/embed_throughput.py --prepare .benchmodels      # here, once (the fp16 MiniLM)
    PYTHONPATH=. HF_HUB_OFFLINE=1 python bench/ingest_gpu.py --embedder .benchmodels/minilm   # on the device

The corpus is JSONL records (no document parser needed, so this runs where unstructured is not
installed): `--records` records of random vocabulary words with the lengths of the chunks `rag
ingest examples/lab-docs` makes (40–150 words), one chunk each. For each setting of
TOKENIZERS_PARALLELISM (unset: the CLI's default; "false": what the CLI set before), in fresh
subprocesses: `rag ingest DIR --json --store memory` on an empty data directory (the embed stage's
own clock from its summary, and the whole run), and the peer in the same environment: our
`Embedder.embed` alone over the same texts in one call. Printed: chunks per second of each and the
ratio of ingest's embed stage to the embedder alone, the hardware and the date.

`--chunk-batch 1 256` runs each setting with RAG_INGEST_CHUNK_BATCH=1 (parse and tokenize one
record at a time: the path before batched chunking) and =256 (the default), in the same run.
`--overlap true false` runs each with the embedding overlapped with reading, chunking and writing
(RAG_INGEST_OVERLAP_EMBEDDING=true, the default) and without. `--switch-ms 0 0.1` runs each with
the interpreter's own GIL switch interval (5 ms) while the embed thread runs, and with 0.1 ms
(RAG_INGEST_SWITCH_INTERVAL_MS; rag/switch_interval.py). `--embed-process false true` runs each with
the embedder in the ingest process and in a worker process of its own (RAG_INGEST_EMBED_PROCESS;
the default on a GPU is the worker). The ingest's wall and total include whatever of the worker's
start (spawn, imports, model load) the walk and the first batches did not hide; the peer's time
excludes its load. With the worker the stages line also has `embed_in_worker`, the worker's own
seconds inside its embed calls (the rest of `embed` is transfer and waiting). `--batch-chunks 4096
16384` runs each with that many chunks per embed call (RAG_INGEST_BATCH_CHUNKS; 4096 is the GPU
default), `--rayon-threads 16 8` with the tokenizer's thread pool of the ingest process (and of the
worker, which inherits it) capped (RAYON_NUM_THREADS; unset: one thread a core in the ingest process).
`--write-behind true false` runs each with the store writes on a writer thread of their own and on
the ingest thread (RAG_INGEST_WRITE_BEHIND; the stages line then has `writer_idle`, the writer's
wait for the embedder). `--rounds 2` runs all of it twice, in turn. `--device cpu` runs where there is no GPU (use few
records); `--parallelism unset` skips the "false" setting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAG = [sys.executable, "-c", "from rag.cli import main; main()"]

ALONE = """
import json, sys, time
import torch
from ingest.embed.embedder import Embedder, EmbedderConfig
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
device = sys.argv[3]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
emb = Embedder(EmbedderConfig(model=sys.argv[2], device=device))
warm = texts[:2048 if device == "cuda" else 64]
t = time.perf_counter(); emb.embed(warm); sync()   # warm-up: kernels, allocator (timed: ingest pays it)
cold = time.perf_counter() - t
t = time.perf_counter(); emb.embed(warm); sync()
again = time.perf_counter() - t
t = time.perf_counter(); emb.embed(texts); sync()
print(json.dumps({"seconds": time.perf_counter() - t, "chunks": len(texts), "cold_s": cold, "warm_s": again,
                  "warm_chunks": len(warm)}))
"""


def make_corpus(path: Path, records: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    vocabulary = [w.strip() for w in (ROOT / "examples" / "lab-docs").rglob("*.md")
                  for w in w.read_text().split() if w.isalpha()]
    with path.open("w") as out:
        for i in range(records):
            words = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(40, 150)))
            out.write(json.dumps({"id": f"r{i}", "text": words, "acl": ["public"]}) + "\n")


def run(setting: str | None, corpus: Path, embedder: str, device: str = "cuda", chunk_batch: int | None = None,
        peer: bool = True, overlap: str | None = None, switch_ms: str | None = None,
        embed_process: str | None = None, batch_chunks: str | None = None, rayon: str | None = None,
        profile: int = 0, write_behind: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if setting is not None:
        env["TOKENIZERS_PARALLELISM"] = setting
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(RAG_DEVICE=device, RAG_EMBEDDER=embedder, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    if chunk_batch is not None:
        env["RAG_INGEST_CHUNK_BATCH"] = str(chunk_batch)
    if overlap is not None:
        env["RAG_INGEST_OVERLAP_EMBEDDING"] = overlap
    if switch_ms is not None:
        env["RAG_INGEST_SWITCH_INTERVAL_MS"] = switch_ms
    if embed_process is not None:
        env["RAG_INGEST_EMBED_PROCESS"] = embed_process
    if batch_chunks is not None:
        env["RAG_INGEST_BATCH_CHUNKS"] = batch_chunks
    if rayon is not None:
        env["RAYON_NUM_THREADS"] = rayon
    if write_behind is not None:
        env["RAG_INGEST_WRITE_BEHIND"] = write_behind
    with tempfile.TemporaryDirectory() as home:
        env["RAG_HOME"] = home
        stats = Path(home) / "ingest.prof"
        # In a `-c` program, as RAG is: a spawned worker then does not run the profiler's main again.
        command = [sys.executable, "-c", f"import cProfile; cProfile.run('from rag.cli import main; main()', "
                   f"{str(stats)!r})"] if profile else RAG
        t = time.perf_counter()
        r = subprocess.run(command + ["ingest", str(corpus.parent), "--json", "--store", "memory"], env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        if profile and r.returncode == 0:
            import pstats

            pstats.Stats(str(stats)).sort_stats("tottime").print_stats(profile)
    if r.returncode != 0:
        sys.exit(f"rag ingest failed ({r.returncode}):\n{r.stderr[-3000:]}")
    summary = json.loads(r.stdout)
    if not peer:
        return {"summary": summary, "wall": wall, "peer": None}
    alone = subprocess.run([sys.executable, "-c", ALONE, str(corpus), embedder, device], env=env,
                           capture_output=True, text=True)
    if alone.returncode != 0:
        sys.exit(f"embedder alone failed:\n{alone.stderr[-3000:]}")
    peer = json.loads(alone.stdout.strip().splitlines()[-1])
    return {"summary": summary, "wall": wall, "peer": peer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embedder", required=True, help="a local encoder folder (e.g. .benchmodels/minilm)")
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--chunk-batch", type=int, nargs="+", default=[None],
                    help="RAG_INGEST_CHUNK_BATCH values to run (1: one record at a time, the old path)")
    ap.add_argument("--parallelism", choices=["both", "unset"], default="both")
    ap.add_argument("--overlap", nargs="+", choices=["true", "false"], default=[None],
                    help="RAG_INGEST_OVERLAP_EMBEDDING values to run (false: embed, then write, then chunk on)")
    ap.add_argument("--switch-ms", nargs="+", default=[None],
                    help="RAG_INGEST_SWITCH_INTERVAL_MS values to run (0: the interpreter's 5 ms while overlapped)")
    ap.add_argument("--embed-process", nargs="+", choices=["true", "false"], default=[None],
                    help="RAG_INGEST_EMBED_PROCESS values to run (true: the model in a worker process)")
    ap.add_argument("--batch-chunks", nargs="+", default=[None],
                    help="RAG_INGEST_BATCH_CHUNKS values to run (chunks per embed call)")
    ap.add_argument("--rayon-threads", nargs="+", default=[None],
                    help="RAYON_NUM_THREADS values to run (the tokenizer's threads)")
    ap.add_argument("--write-behind", nargs="+", choices=["true", "false"], default=[None],
                    help="RAG_INGEST_WRITE_BEHIND values to run (true: store writes on a writer thread of their own)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run each ingest under cProfile and print its N costliest functions (own time)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every setting this many times, in turn (single runs differ by ~15%%), each round "
                         "with its own peer")
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus" / "records.jsonl"
        corpus.parent.mkdir()
        make_corpus(corpus, args.records)
        hardware = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU only ({platform.processor()})"
        cores = len(os.sched_getaffinity(0))
        print(f"# {datetime.date.today()}; {hardware}; {cores} usable CPU cores "
              f"({platform.machine()}); torch {torch.__version__}; {args.records} records")
        print("| round | TOKENIZERS_PARALLELISM | chunk batch | overlap | GIL switch ms | embed process: ran "
              "| embed call | tokenizer threads | write behind | ingest wall | ingest embed stage | embedder alone "
              "| embed stage / alone | ingest total / alone |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        settings = [(r, p) for r in range(1, args.rounds + 1)
                    for p in ((None, "false") if args.parallelism == "both" else (None,))]
        for round_no, setting in settings:
            peer_s = None
            runs = [(c, o, m, e, b, r, w) for c in args.chunk_batch for o in args.overlap for m in args.switch_ms
                    for e in args.embed_process for b in args.batch_chunks for r in args.rayon_threads
                    for w in args.write_behind]
            for chunk_batch, overlap, switch_ms, embed_process, batch_chunks, rayon, write_behind in runs:
                out = run(setting, corpus, args.embedder, args.device, chunk_batch, peer=peer_s is None,
                          overlap=overlap, switch_ms=switch_ms, embed_process=embed_process,
                          batch_chunks=batch_chunks, rayon=rayon, profile=args.profile, write_behind=write_behind)
                s = out["summary"]
                if out["peer"] is not None:
                    peer_s = out["peer"]["seconds"]
                    peer = out["peer"]["chunks"] / peer_s
                chunks = s.get("chunks_written") or s.get("chunks_embedded")
                embed_s, total_s = s["seconds"]["embed"], s["seconds"]["total"]
                # Where the model ran, from the report itself (a setting the command ignored once
                # went unnoticed: the CLI kept the model in process, 659c962 to 26ba8fc).
                ran = "worker" if "embed_in_worker" in s["seconds"] else "in process"
                print(f"| {round_no} | {setting or 'unset (CLI default)'} | {chunk_batch or 'default'}"
                      f" | {overlap or 'default'}"
                      f" | {switch_ms or 'default'} | {embed_process or 'default'}: {ran}"
                      f" | {batch_chunks or 'default'}"
                      f" | {rayon or 'default'} | {write_behind or 'default'}"
                      f" | {out['wall']:.1f} s ({s['added'] / out['wall']:.0f} docs/s)"
                      f" | {chunks / embed_s:,.0f} chunks/s ({embed_s:.1f} s) | {peer:,.0f} chunks/s ({peer_s:.1f} s)"
                      f" | {chunks / embed_s / peer:.2f}x | {peer_s / total_s:.2f}x ({total_s:.1f} s) |", flush=True)
                print(f"  stages: {json.dumps({k: round(v, 2) for k, v in s['seconds'].items()})}", flush=True)
                if out["peer"] is not None:  # what the first call of a fresh embedder pays (ingest's first batch does)
                    p = out["peer"]
                    print(f"  embedder alone, first {p['warm_chunks']} texts: cold {p['cold_s']:.2f} s, "
                          f"warm {p['warm_s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
