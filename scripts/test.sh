#!/usr/bin/env bash
# Set everything up (idempotent) and run every test that needs no GPU, `slow` ones included (what CI
# runs). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k ingest`; a later `-m` wins, so
# `bash scripts/test.sh -m 'not gpu and not slow'` is the quick edit-test loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -m "not gpu" --durations=15 "$@"
