"""Peak memory and speed of `rag ingest` as the corpus grows: flat, but for a small record per document.

    PYTHONPATH=. .venv/bin/python bench/ingest_memory.py                        # 5k, 10k, 20k docs: ~40 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/ingest_memory.py --sizes 1000 2000      # a quick look

Each size gets a corpus of small documents (~200 bytes: 80% .txt files, 100 per directory,
two levels deep, some directories with their own .rag-acl.toml; 20% records in JSONL files of
1,000), and `rag ingest --json` runs on it as a subprocess, twice: the first ingest (everything
embedded with the packaged MiniLM on CPU), then a re-run (everything unchanged). Peak RSS is
the child's ru_maxrss (os.wait4). The peer is the same command over 1,000 documents (enough to
fill the embedder's batches), measured in the same run: the ratio peak(N) / peak(1,000) shows
whether memory grows with the corpus, and (peak(N) - peak(1,000)) / (N - 1,000) what each
document costs. What is expected to grow: the stored state of each document (key, hash, ACL:
measured with tracemalloc on each catalog) and the Faiss index itself (dim x 4 bytes per
chunk, which a flat index must hold to be searched or written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("centrifuge freezer buffer reagent microscope booking cluster node queue backup quota sample plate "
         "incubator sequencer pipette alarm threshold protocol storage").split()
RAG = [sys.executable, "-c", "from rag.cli import main; main()"]
BASELINE = 1000  # enough documents to fill the embedder's batches: the peer peak includes a full batch


def make_corpus(root: Path, n: int, seed: int = 0) -> None:
    """n documents of ~200 bytes: 80% files in nested directories, 20% JSONL records."""
    rng = random.Random(seed)

    def text(i: int) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(40))
        return f"Note {i}: {words}"[:196] + ".\n"

    root.mkdir(parents=True)
    (root / ".rag-acl.toml").write_text('allow = ["public"]\n')
    n_records = n // 5
    n_files = n - n_records
    for i in range(n_files):
        d = root / f"g{i // 1000:03d}" / f"s{(i // 100) % 10}"
        if i % 100 == 0:
            d.mkdir(parents=True, exist_ok=True)
            if (i // 100) % 10 == 3:
                (d / ".rag-acl.toml").write_text(f'allow = ["group:g{i // 1000}"]\n')
        (d / f"doc{i:06d}.txt").write_text(text(i))
    for start in range(0, n_records, 1000):
        with (root / f"records{start // 1000:03d}.jsonl").open("w") as f:
            for i in range(start, min(start + 1000, n_records)):
                record = {"id": f"r{i}", "text": text(n_files + i)}
                if i % 10 == 0:
                    record["acl"] = ["group:admins"]
                f.write(json.dumps(record) + "\n")


def run_ingest(home: Path, corpus: Path, log: Path, extra: list[str]) -> tuple[dict, int, float, list[int]]:
    """One `rag ingest --json` (+ extra options): (summary, peak RSS in bytes, wall seconds, RSS samples).

    The samples (bytes, every 0.25 s) show the shape behind the peak: the embedder's batches
    allocate and free tens of MB each, so RSS swings by a few hundred MB throughout a run, and
    the peak is the highest swing, which a longer run is likelier to reach.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    samples: list[int] = []
    with log.open("w") as out, (log.with_suffix(".err")).open("w") as err:
        proc = subprocess.Popen(RAG + ["--home", str(home), "ingest", str(corpus), "--json", *extra], env=env,
                                stdout=out, stderr=err)
        sampler = threading.Thread(target=_sample_rss, args=(proc.pid, samples), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.join()
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"rag ingest failed ({proc.returncode}): {log.with_suffix('.err').read_text()[-2000:]}")
    return json.loads(log.read_text()), usage.ru_maxrss * 1024, wall, samples


def _sample_rss(pid: int, samples: list[int]) -> None:
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
        except (OSError, StopIteration):  # gone (or a zombie without memory)
            return
        samples.append(int(line.split()[1]) * 1024)
        time.sleep(0.25)


def _quantile(values: list[int], q: float) -> float:
    ordered = sorted(values) or [0]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def state_bytes(home: Path) -> tuple[int, int, int]:
    """(documents, chunks, bytes of the per-document state an ingest run holds) for a data directory."""
    from retrieval.stores.embedded.catalog import Catalog

    catalog = Catalog(home / "catalog.sqlite")
    stats = catalog.collection_stats("default")
    tracemalloc.start()
    states = catalog.document_states("default")
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del states
    catalog.close()
    return stats["documents"], stats["chunks"], size


def start_postgres(home: Path) -> str:
    """Start (or find) the local PostgreSQL + pgvector server of `home`; its DSN."""
    from rag.local_postgres.server import local_dsn

    subprocess.run(RAG + ["--home", str(home), "db", "start"], check=True, capture_output=True)
    dsn = local_dsn(home)
    assert dsn, "rag db start left no running server"
    return dsn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 10000, 20000])
    parser.add_argument("--keep", type=Path, help="keep corpora and data directories here")
    parser.add_argument("--store", default="faiss", choices=["faiss", "pgvector"],
                        help="pgvector: vectors live in a local server (`rag db start`), outside the measured process")
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="ingest-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# ingest memory — {platform.node()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {datetime.date.today()}")
    print(f"# load average at start: {os.getloadavg()[0]:.1f} (a shared machine slows the rates, not the memory)")
    rows = []
    dsn = start_postgres(work / "pg-home") if args.store == "pgvector" else None
    print(f"# store: {args.store}", flush=True)
    for n in [BASELINE, *args.sizes]:
        corpus, home = work / f"corpus-{n}", work / f"home-{n}"
        if not corpus.exists():
            make_corpus(corpus, n)
        shutil.rmtree(home, ignore_errors=True)  # a first ingest each time, also with --keep
        # pgvector: a new collection each time (the server outlives the data directories)
        extra = ["--store", args.store] + (["--dsn", dsn, "--collection", f"c{n}_{int(time.time())}"] if dsn else [])
        first, peak, wall, samples = run_ingest(home, corpus, work / f"first-{n}.json", extra)
        again, peak_again, wall_again, _ = run_ingest(home, corpus, work / f"again-{n}.json", extra)
        first["rss_median"], first["rss_p90"] = _quantile(samples, 0.5), _quantile(samples, 0.9)
        if dsn:
            docs, chunks, states = first["collection_stats"]["documents"], first["collection_stats"]["chunks"], 0
        else:
            docs, chunks, states = state_bytes(home)
        assert again["unchanged"] == first["documents"] and again["chunks_written"] == 0, again
        rows.append((n, docs, chunks, first, peak, wall, again, peak_again, wall_again, states))
        print(f"  {n} documents: first {wall:.0f}s, peak {peak / 2**20:.0f} MiB; re-run {wall_again:.0f}s, "
              f"peak {peak_again / 2**20:.0f} MiB", flush=True)

    base_peak, base_again = rows[0][4], rows[0][7]
    print("\n| documents | chunks | first ingest: wall s | docs/s | parse / chunk / embed / write docs/s "
          "| embed chunks/s | RSS median / p90 MiB | peak RSS MiB | vs 1,000 docs | growth B/doc "
          "| since previous B/doc "
          "| re-run: wall s | docs/s | peak RSS MiB | growth B/doc | state B/doc |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    previous = rows[0]
    for n, docs, chunks, first, peak, wall, _again, peak_again, wall_again, states in rows:
        rates = first["rates"]
        stage = " / ".join(f"{rates[f'{s}_documents_per_second']:.0f}" for s in ("parse", "chunk", "embed", "write"))
        extra = max(docs - rows[0][1], 1)
        growth = (peak - base_peak) / extra if n != BASELINE else 0
        growth_again = (peak_again - base_again) / extra if n != BASELINE else 0
        marginal = (peak - previous[4]) / max(docs - previous[1], 1) if n != BASELINE else 0
        previous = (n, docs, chunks, first, peak)
        print(f"| {docs:,} | {chunks:,} | {wall:.0f} | {docs / wall:.1f} | {stage} | "
              f"{rates['embed_chunks_per_second']:.0f} | "
              f"{first['rss_median'] / 2**20:.0f} / {first['rss_p90'] / 2**20:.0f} | "
              f"{peak / 2**20:.0f} | {peak / base_peak:.2f}x | "
              f"{growth:,.0f} | {marginal:,.0f} | {wall_again:.0f} | {docs / wall_again:.0f} | "
              f"{peak_again / 2**20:.0f} | {growth_again:,.0f} | {states / max(docs, 1):,.0f} |")
    if dsn:
        subprocess.run(RAG + ["--home", str(work / "pg-home"), "db", "stop"], check=False, capture_output=True)
    else:
        print(f"\nFaiss flat index: {rows[-1][2]:,} chunks x 384 dims x 4 bytes = "
              f"{rows[-1][2] * 384 * 4 / 2**20:.0f} MiB at the largest size (held to be searched or written).")
    print(f"# load average at end: {os.getloadavg()[0]:.1f}; data in {work}")


if __name__ == "__main__":
    main()
