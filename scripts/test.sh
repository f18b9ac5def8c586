#!/usr/bin/env bash
# Set everything up (idempotent) and run the default test suite (not `gpu`, not `slow`).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k ingest`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
