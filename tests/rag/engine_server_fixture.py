"""`engine_server`: one real `rag engine serve default` subprocess (SmolLM2 on CPU) for the whole session.

Use it from a test module with `pytest_plugins = ["tests.rag.engine_server_fixture"]` (and no
import of this module at run time, so pytest can rewrite its asserts): registered once as a plugin,
every module shares one server. Importing the fixture function into each module instead would
start one server per module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-engine-key-5f1c0b9e"
READY = re.compile(r"serving (\S+) on (http://\S+/v1)")
START_TIMEOUT = 300.0  # importing torch, converting the GGUF when no earlier test did (~20-35 s), loading


@dataclass
class EngineServer:
    """A running server: where it is, its key, and its engine's counters."""

    base_url: str  # http://127.0.0.1:PORT/v1
    root_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    process: subprocess.Popen
    log_path: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def metrics(self) -> dict:
        """GET /metrics/engine: num_running, num_kv_blocks_used, prefix_cache_hit_tokens, ..."""
        response = httpx.get(f"{self.root_url}/metrics/engine", headers=self.auth, timeout=10)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll the counters until no request is running or waiting, no KV block is held, and no token is made.

        Idle must hold for two reads 0.2 s apart with the same num_generated_tokens (a snapshot is
        read while the step thread runs, so one read alone could catch it mid-step). The deadline
        only bounds a failing test; what it checks is the counters.
        """
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while True:
            m = self.metrics()
            idle = m["num_running"] == 0 and m["num_waiting"] == 0 and m["num_kv_blocks_used"] == 0
            if idle and last is not None and last["num_generated_tokens"] == m["num_generated_tokens"]:
                return m
            last = m if idle else None
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy after {timeout} s: {m}")
            time.sleep(0.2 if idle else 0.05)

    def wait_busy(self, timeout: float = 30.0) -> dict:
        """Poll the counters until a request holds KV blocks (a single read may catch a step midway)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["num_running"] + m["num_waiting"] >= 1 and m["num_kv_blocks_used"] > 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"no request in the engine after {timeout} s: {m}")
            time.sleep(0.02)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@pytest.fixture(scope="session")
def engine_server(model_cache: Path, tmp_path_factory) -> Iterator[EngineServer]:
    """`rag engine serve default --port 0 --api-key-file F` on CPU; stopped (SIGTERM, by PID) at the end."""
    home = tmp_path_factory.mktemp("engine-home")
    # The session's model cache: the GGUF conversion is shared with every other test.
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    key_file = home / "engine.key"
    key_file.write_text(API_KEY + "\n")
    log_path = home / "server.log"
    env = {**os.environ, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           # One intra-op thread: on 2 busy cores a second one mostly waits (see tests/generation/conftest.py).
           "OMP_NUM_THREADS": "1"}
    env.pop("RAG_ENGINE_API_KEY", None)
    cmd = [sys.executable, "-c", "from rag.cli import main; main()", "engine", "serve", "default",
           "--port", "0", "--api-key-file", str(key_file), "--device", "cpu", "--num-kv-blocks", "512",
           "--max-model-len", "2048", "--max-num-seqs", "4", "--log-level", "warning"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        match = None
        while match is None:
            match = READY.search(log_path.read_text(errors="replace"))
            if match is None:
                if process.poll() is not None:
                    raise AssertionError(f"rag engine serve exited ({process.returncode}):\n"
                                         f"{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"rag engine serve not ready in {START_TIMEOUT} s:\n"
                                         f"{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
        base_url = match.group(2)
        server = EngineServer(base_url, base_url.removesuffix("/v1"), API_KEY, match.group(1), process, log_path)
        assert httpx.get(f"{server.root_url}/health", timeout=10).status_code == 200
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
