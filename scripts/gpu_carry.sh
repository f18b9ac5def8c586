#!/usr/bin/env bash
# What the GPU tests need beside the tree, in .gpu-carry/ (ignored; name it in the device tool's
# `carry`): the packaged MiniLM embedder stored in float16 (45 MB; the fp32 files are 88 MB, over
# what travels in one call with the tree). Run here, after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - <<'PY'
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from ingest.embed.embedder import default_embedder_path

source, dest = default_embedder_path(), Path(".gpu-carry/minilm")
dest.mkdir(parents=True, exist_ok=True)
AutoModel.from_pretrained(source, local_files_only=True).to(torch.float16).save_pretrained(dest)
AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(dest)
print(f"{dest}: {sum(f.stat().st_size for f in dest.iterdir()) / 1e6:.0f} MB")
PY
