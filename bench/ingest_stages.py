"""End-to-end `rag ingest` on this machine, by stage, over real document formats.

    PYTHONPATH=. .venv/bin/python bench/ingest_stages.py                 # 20 copies of examples/lab-docs
    PYTHONPATH=. .venv/bin/python bench/ingest_stages.py --copies 5      # a quick look

The corpus is `--copies` copies of the sample lab documents (PDF, DOCX, HTML, Markdown, text,
JSONL records, with their sidecar ACL files), each copy in its own directory, so every document
is parsed, chunked, embedded (the packaged MiniLM, on the CPU unless RAG_EMBED_DEVICE says
otherwise) and written again. `rag ingest --json` runs as a subprocess, first on the empty data
directory and then again (everything unchanged: the incremental path). Printed: documents per
second overall and per stage (from the ingest summary's own stage clocks), chunks and tokens
per second of the embedder, and the seconds each stage took. Peer in the same run: the embedder
alone on the same chunk texts (sentence-transformers-free: `Embedder.embed`), which shows how
much of the wall time the rest of the pipeline adds.

    PYTHONPATH=. .venv/bin/python bench/ingest_stages.py --copies 5 --parse-only --workers 1 2 1 2

`--parse-only` times the parse stage alone over the same corpus, in turn for each `--workers`
value, through the pipeline's own parse-ahead (`IngestPipeline._parsed_ahead`, chunking left
out): 1 parses in this process (`ingest_workers = 1`), N starts a pool of N processes (forked from
the warm forkserver, which the first pool of the run starts and pays for) as
each `rag ingest` does. Each time includes starting the pool and the parsers' imports in its
processes (the first in-process run pays the import in this process; later ones do not).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RAG = [sys.executable, "-c", "from rag.cli import main; main()"]


def make_corpus(dst: Path, copies: int) -> collections.Counter:
    """`copies` copies of examples/lab-docs under dst; returns file counts by suffix."""
    src = ROOT / "examples" / "lab-docs"
    for i in range(copies):
        shutil.copytree(src, dst / f"copy{i:03d}")
    return collections.Counter(p.suffix for p in dst.rglob("*") if p.is_file() and p.suffix != ".toml")


def ingest(home: Path, corpus: Path) -> tuple[dict, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run(RAG + ["--home", str(home), "ingest", str(corpus), "--json"], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"rag ingest failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), wall


def embedder_alone(home: Path) -> tuple[int, int, float]:
    """The embedder alone on the collection's chunk texts: (chunks, tokens, seconds)."""
    from ingest.embed.embedder import Embedder, EmbedderConfig
    from retrieval.stores.embedded.catalog import Catalog

    catalog = Catalog(home / "catalog.sqlite")
    texts = [r["text"] for r in catalog.dump("default")]
    catalog.close()
    embedder = Embedder(EmbedderConfig(device=os.environ.get("RAG_EMBED_DEVICE", "cpu")))
    embedder.embed(texts[:64])  # warm-up
    started = time.perf_counter()
    embedder.embed(texts)
    seconds = time.perf_counter() - started
    tokens = sum(len(embedder.tokenizer.encode(t)) for t in texts)
    embedder.close()
    return len(texts), tokens, seconds


def parse_only(corpus: Path, workers: int) -> tuple[int, int, float]:
    """The pipeline's parse-ahead (`IngestPipeline._parsed_ahead`, windows of 256) over `corpus` with
    `workers` processes, chunking left out: (sources, failed, seconds)."""
    import types

    from ingest.pipeline import IngestPipeline, _Clock
    from ingest.sources import SourceItem, walk_sources

    items = list(walk_sources([corpus]))
    chunker = types.SimpleNamespace(count_batch=lambda texts: {}, use_counts=lambda counts: None)
    pipeline = IngestPipeline(None, None, chunker, chunk_batch=256, workers=workers)  # type: ignore[arg-type]
    started = time.perf_counter()
    parsed = [p for _, p in pipeline._parsed_ahead(iter(items), lambda i: isinstance(i, SourceItem), _Clock({}))]
    seconds = time.perf_counter() - started
    return len(parsed), sum(isinstance(p, Exception) for p in parsed), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--parse-only", action="store_true", help="time the parse stage alone")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="with --parse-only: runs, in turn")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ingest-stages-"))
    print(f"# ingest by stage — {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs "
          f"({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}, {datetime.date.today()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    files = make_corpus(work / "corpus", args.copies)
    print("# files: " + ", ".join(f"{n} {suffix}" for suffix, n in sorted(files.items())))
    if args.parse_only:
        print("| parse workers | sources | failed | seconds | sources/s | vs first 1-worker run |")
        print("|---|---|---|---|---|---|")
        base = None
        for workers in args.workers:
            n, failed, seconds = parse_only(work / "corpus", workers)
            base = base or (seconds if workers == 1 else None)
            ratio = f"{base / seconds:.2f}x" if base else "-"
            print(f"| {workers} | {n} | {failed} | {seconds:.1f} | {n / seconds:.1f} | {ratio} |"
                  f"  (load average {os.getloadavg()[0]:.1f})", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return
    first, wall = ingest(work / "home", work / "corpus")
    again, wall_again = ingest(work / "home", work / "corpus")
    docs, sec, rates = first["documents"], first["seconds"], first["rates"]
    print(f"first ingest: {docs} documents, {first['chunks_written']} chunks, {first['tokens_embedded']:,} tokens "
          f"in {wall:.1f} s wall ({docs / wall:.1f} docs/s, process start and model load included; "
          f"{rates['documents_per_second']:.1f} docs/s in the pipeline)")
    print("| stage | seconds | share | documents/s |")
    print("|---|---|---|---|")
    for stage in ("scan", "parse", "chunk", "embed", "write", "delete", "save"):
        rate = rates.get(f"{stage}_documents_per_second")
        print(f"| {stage} | {sec[stage]:.2f} | {sec[stage] / sec['total'] * 100:.0f}% | "
              f"{f'{rate:,.0f}' if rate else '-'} |")
    print(f"| total (pipeline) | {sec['total']:.2f} | 100% | {rates['documents_per_second']:.1f} |")
    print(f"embedder inside ingest: {rates['embed_chunks_per_second']:.1f} chunks/s, "
          f"{rates['embed_tokens_per_second']:,.0f} tokens/s")
    chunks, tokens, alone = embedder_alone(work / "home")
    print(f"peer, the embedder alone on the same {chunks} chunks: {alone:.1f} s ({chunks / alone:.1f} chunks/s, "
          f"{tokens / alone:,.0f} tokens/s); the embed stage took {sec['embed']:.1f} s "
          f"({sec['embed'] / alone:.2f}x), the whole pipeline {sec['total']:.1f} s ({sec['total'] / alone:.2f}x)")
    print(f"re-run, everything unchanged: {again['unchanged']} unchanged in {wall_again:.1f} s wall "
          f"({again['documents'] / wall_again:.0f} docs/s)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
