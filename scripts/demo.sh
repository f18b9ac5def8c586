#!/usr/bin/env bash
# The quick-start demo: set everything up, ingest the sample lab documents with their
# permissions, and ask the same questions as users with different groups.
# Data goes to $RAG_HOME (default ./.rag-demo); a second run is incremental and quick.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAG_HOME=${RAG_HOME:-$PWD/.rag-demo}
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
rag=.venv/bin/rag

echo "== users"
$rag users add alice --group genomics
$rag users add bob --group imaging
$rag users add carol --group hpc-admins
$rag users add dave

echo
echo "== ingest examples/lab-docs (permissions from .rag-acl.toml sidecars)"
$rag ingest examples/lab-docs

ask() {
  echo
  echo "== \"$1\" asked by $2"
  $rag query "$1" --as "$2" --k 3
}
ask "Which GPU nodes can I use?" dave
ask "Which GPU nodes can I use?" bob
ask "What temperature is the -80 freezer alarm set to?" alice
ask "What temperature is the -80 freezer alarm set to?" bob
