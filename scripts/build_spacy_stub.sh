#!/usr/bin/env bash
# Build and install a weightless `en_core_web_sm` so unstructured works offline.
#
# unstructured 0.27 calls spacy.load("en_core_web_sm") on first use and downloads the
# model from GitHub when it is missing; offline that fails for every partitioner. Any
# importable package of that name satisfies it, so we package spacy.blank("en") plus a
# rule-based sentencizer (~150 KB, no third-party weights). Side effect: without a
# tagger, short sentences are classified as Title rather than NarrativeText.
#
# Usage: scripts/build_spacy_stub.sh [VENV_PYTHON]   (default: python3)
# Idempotent: does nothing when `import en_core_web_sm` already works.
set -euo pipefail

PY="${1:-python3}"
# The version unstructured pins in unstructured/nlp/tokenize.py (_SPACY_MODEL_VERSION).
STUB_VERSION="3.8.0"

if "$PY" -c "import en_core_web_sm" 2>/dev/null; then
    echo "en_core_web_sm is already importable with $PY; nothing to do."
    exit 0
fi

if ! "$PY" -c "import spacy" 2>/dev/null; then
    echo "error: spacy is not installed for $PY; install it first (pip install 'spacy>=3.7')." >&2
    exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PY" - "$WORK/pipeline" <<'EOF'
import sys

import spacy

nlp = spacy.blank("en")
nlp.add_pipe("sentencizer")
nlp.meta["name"] = "core_web_sm"
nlp.meta["description"] = "Offline stub: blank English tokenizer + rule-based sentencizer."
nlp.to_disk(sys.argv[1])
EOF

mkdir -p "$WORK/out"
# --build none: `spacy package` would otherwise run `python -m build`, which may be absent;
# pip builds the package directory itself below.
"$PY" -m spacy package "$WORK/pipeline" "$WORK/out" \
    --name core_web_sm --version "$STUB_VERSION" --build none --force

PKG_DIR="$WORK/out/en_core_web_sm-$STUB_VERSION"
# --no-build-isolation: use the venv's setuptools instead of fetching one (works offline);
# --no-deps: spacy is already installed and must not be upgraded or replaced.
"$PY" -m pip install --no-build-isolation --no-deps "$PKG_DIR"

"$PY" -c "import en_core_web_sm, spacy; nlp = spacy.load('en_core_web_sm'); \
print('installed en_core_web_sm', en_core_web_sm.__version__ if hasattr(en_core_web_sm, '__version__') else '', nlp.pipe_names)"
