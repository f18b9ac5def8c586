#!/usr/bin/env bash
# Set everything up (idempotent) and run every test that needs no GPU, `slow` ones included (what CI
# runs). Extra arguments go to pytest, e.g. `bash scripts/test.sh -k ingest`; a later `-m` wins, so
# `bash scripts/test.sh -m 'not gpu and not slow'` is the quick edit-test loop (~2 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# A full run (no arguments, as CI) also needs LiteLLM's own virtualenv (~700 MB of downloads):
# installed beside the main setup and the first tests instead of inside the LiteLLM test's
# fixture, which waits for it (scripts/setup_litellm.sh takes a lock) and reports any failure.
if [ $# -eq 0 ]; then
  bash scripts/setup_litellm.sh >"${TMPDIR:-/tmp}/rag-setup-litellm.$$.log" 2>&1 &
fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# Three test processes (RAG_TEST_WORKERS, default 3; 0 runs in this process): most tests hold one
# core (servers and engines are started with one thread, much of the rest is Python), but many
# wait on a subprocess (a server starting, a CLI run, Slurm), so a third keeps 2 cores busy:
# 12:55 against 15:29 with two, 2026-12-06. Each test file stays in one process, with its module fixtures.
workers=${RAG_TEST_WORKERS:-3}
# One torch thread per process when there are several: two of two each would fight over the cores.
if [ "$workers" -ge 2 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
# -rfEs lists failures, errors and every skip with its reason (in CI, CI=true turns skips into
# failures: tests/ci_gate.py).
exec .venv/bin/python -m pytest -q -rfEs -m "not gpu" --durations=15 -n "$workers" --dist loadfile "$@"
