#!/usr/bin/env bash
# The LiteLLM proxy, for the test that puts it in front of `rag serve`
# (tests/rag/test_litellm_proxy.py) and for trying examples/chat-frontends/litellm.yaml.
# Its own virtualenv, .venv-litellm (it never touches .venv): LiteLLM pins many packages of its
# own and needs no torch. Idempotent: nothing to do when .venv-litellm/bin/litellm already runs
# as the pinned version. A fresh install takes about 40 s here (~700 MB).
set -euo pipefail
cd "$(dirname "$0")/.."

LITELLM_VERSION=${RAG_LITELLM_VERSION:-1.108.7}  # overridable for the setup script's own test
VENV=${RAG_LITELLM_VENV:-.venv-litellm}
PYTHON=${PYTHON:-python3}

# One install at a time: scripts/test.sh starts this in the background while the main setup
# runs, and the LiteLLM test calls it again; the second caller waits here, then finds it done.
exec 9>"$VENV.lock"
flock 9

works() {
  [ -x "$VENV/bin/litellm" ] \
    && LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/litellm" --version 2>/dev/null \
       | grep -q "Current Version = $LITELLM_VERSION\$"
}

if works; then
  echo "== litellm $LITELLM_VERSION already in $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
echo "== installing litellm[proxy]==$LITELLM_VERSION into $VENV"
# Exit status 3 only where no package registry answers (an offline machine): callers may skip
# then, outside CI. Any other pip failure (a broken dependency, a wheel that does not build, a
# registry that answers but lacks the release) is exit status 1: a failure, never a skip.
log=$(mktemp)
if ! "$VENV/bin/python" -m pip install -q "litellm[proxy]==$LITELLM_VERSION" >"$log" 2>&1; then
  grep -v "^WARNING: Location .* is ignored" "$log" | tail -20 >&2
  rm -f "$log"
  # Does the registry answer at all? `pip index versions` uses pip's own index, proxy and certs.
  # (Read whole before matching: under pipefail, `grep -q` closing the pipe early fails pip.)
  index=$("$VENV/bin/python" -m pip index versions litellm --timeout 20 --retries 1 2>/dev/null || true)
  if grep -q "^litellm (" <<<"$index"; then
    echo "setup_litellm: pip could not install litellm[proxy]==$LITELLM_VERSION although the registry answers" >&2
    exit 1
  fi
  echo "setup_litellm: no package registry reachable; litellm[proxy]==$LITELLM_VERSION not installed" >&2
  exit 3
fi
rm -f "$log"
works || { echo "setup_litellm: $VENV/bin/litellm does not run after the install" >&2; exit 1; }
echo "== litellm $LITELLM_VERSION ready in $VENV"
