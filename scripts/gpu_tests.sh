#!/usr/bin/env bash
# Every `gpu` test (CI has no GPU), on a CUDA machine, and docs/gpu-tests.md written from the run,
# tied to the commit the tree is at. Here, on a clean checkout:  bash scripts/gpu_tests.sh
# On the GPU machine of the device tool (a copy of the tree without .git; torch, triton and pytest
# installed; the embedder carried by scripts/gpu_carry.sh into .gpu-carry/):
#   RAG_COMMIT=<40-hex commit> bash scripts/gpu_tests.sh "$OUT"
# The page goes to OUTDIR (default docs/); copy it into docs/ and commit it.
set -uo pipefail
cd "$(dirname "$0")/.."
outdir=${1:-docs}
mkdir -p "$outdir"
PY=${PYTHON:-python3}
if [ -z "${RAG_COMMIT:-}" ]; then
  if ! git diff --quiet HEAD 2>/dev/null; then
    echo "gpu_tests: the tree differs from HEAD; commit first (the page names a commit)" >&2
    exit 2
  fi
  RAG_COMMIT=$(git rev-parse HEAD)
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The embedder's GPU tests read real MiniLM weights; the packaged model is too big to travel, so
# scripts/gpu_carry.sh stores a half-precision copy (the fp32 reference is computed from it too).
if [ -z "${RAG_TEST_EMBEDDER_DIR:-}" ] && [ -f .gpu-carry/minilm/config.json ]; then
  export RAG_TEST_EMBEDDER_DIR=$PWD/.gpu-carry/minilm
fi
# Only the files that mark gpu tests: the rest import what the GPU machine lacks (psycopg, fastapi,
# faiss). tests/test_gpu_test_summary.py checks that this finds every file `-m gpu` collects.
mapfile -t files < <(grep -rl --include='test_*.py' "mark.gpu" tests | sort)
junit=$(mktemp --suffix=.xml)
command="python -m pytest -p no:xdist -m gpu ${files[*]}"
"$PY" -m pytest -p no:xdist -p no:cacheprovider -q -rfEs -m gpu --junitxml="$junit" "${files[@]}" 2>&1 | tee "$outdir/gpu-tests.log"
status=${PIPESTATUS[0]}
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')")
versions=$("$PY" -c "
import platform, torch
try:
    import triton; t = triton.__version__
except ImportError:
    t = 'absent'
import transformers
print(f'Python {platform.python_version()}, torch {torch.__version__}, triton {t}, transformers {transformers.__version__}')")
"$PY" scripts/gpu_test_summary.py --junit "$junit" --commit "$RAG_COMMIT" --device "$device" \
  --versions "$versions" --date "$(date -u +%Y-%m-%d)" --command "$command" --out "$outdir/gpu-tests.md" || status=1
rm -f "$junit"
exit "$status"
