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

echo
echo "== the same service over HTTP: rag serve + the official openai client (streaming, citations)"
port=${RAG_DEMO_PORT:-8765}
bob_key=$($rag keys create --user bob --group imaging --label demo)
dave_key=$($rag keys create --user dave --label demo)
RAG_TOP_K=3 $rag serve --port "$port" > "$RAG_HOME/serve.log" 2>&1 &  # 3 sources, as the queries above
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$port/readyz" > /dev/null 2>&1 && break
  kill -0 $serve_pid 2>/dev/null || { echo "rag serve failed:"; tail -20 "$RAG_HOME/serve.log"; exit 1; }
  sleep 0.5
done
for who in bob dave; do
  key=bob_key; [ "$who" = dave ] && key=dave_key
  echo
  echo "== \"Which GPU nodes can I use?\" asked by $who through /v1/chat/completions"
  .venv/bin/python examples/clients/openai_chat.py --url "http://127.0.0.1:$port/v1" --key "${!key}" \
    "Which GPU nodes can I use?"
done
