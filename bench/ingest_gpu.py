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
emb = Embedder(EmbedderConfig(model=sys.argv[2], device="cuda"))
emb.embed(texts[:2048]); torch.cuda.synchronize()   # warm-up: kernels, allocator
t = time.perf_counter(); emb.embed(texts); torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t, "chunks": len(texts)}))
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


def run(setting: str | None, corpus: Path, embedder: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if setting is not None:
        env["TOKENIZERS_PARALLELISM"] = setting
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(RAG_DEVICE="cuda", RAG_EMBEDDER=embedder, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    with tempfile.TemporaryDirectory() as home:
        env["RAG_HOME"] = home
        t = time.perf_counter()
        r = subprocess.run(RAG + ["ingest", str(corpus.parent), "--json", "--store", "memory"], env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"rag ingest failed ({r.returncode}):\n{r.stderr[-3000:]}")
    summary = json.loads(r.stdout)
    alone = subprocess.run([sys.executable, "-c", ALONE, str(corpus), embedder], env=env, capture_output=True,
                           text=True)
    if alone.returncode != 0:
        sys.exit(f"embedder alone failed:\n{alone.stderr[-3000:]}")
    peer = json.loads(alone.stdout.strip().splitlines()[-1])
    return {"summary": summary, "wall": wall, "peer": peer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embedder", required=True, help="a local encoder folder (e.g. .benchmodels/minilm)")
    ap.add_argument("--records", type=int, default=20000)
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus" / "records.jsonl"
        corpus.parent.mkdir()
        make_corpus(corpus, args.records)
        print(f"# {datetime.date.today()}; {torch.cuda.get_device_name(0)}; {os.cpu_count()} CPU cores "
              f"({platform.machine()}); torch {torch.__version__}; {args.records} records")
        print("| TOKENIZERS_PARALLELISM | ingest wall | ingest embed stage | embedder alone | embed stage / alone |")
        print("|---|---|---|---|---|")
        for setting in (None, "false"):
            out = run(setting, corpus, args.embedder)
            s = out["summary"]
            chunks = s.get("chunks_written") or s.get("chunks_embedded")
            embed_s = s["seconds"]["embed"]
            peer = out["peer"]["chunks"] / out["peer"]["seconds"]
            print(f"| {setting or 'unset (CLI default)'} | {out['wall']:.1f} s ({s['added'] / out['wall']:.0f} docs/s)"
                  f" | {chunks / embed_s:,.0f} chunks/s ({embed_s:.1f} s) | {peer:,.0f} chunks/s"
                  f" | {chunks / embed_s / peer:.2f}x |", flush=True)
            print(f"  stages: {json.dumps({k: round(v, 2) for k, v in s['seconds'].items()})}", flush=True)


if __name__ == "__main__":
    main()
