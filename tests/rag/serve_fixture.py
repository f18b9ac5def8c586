"""Shared by the `rag serve` subprocess tests: a data directory with the sample corpus, and the server."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from tests.rag.conftest import DEMO_USERS, LAB_DOCS, REPO, make_rag

START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, url: str, keys: dict[str, str], process: subprocess.Popen, log: Path, home: Path) -> None:
        self.url, self.keys, self.process, self.log, self.home = url, keys, process, log, home

    def client(self, user: str = "bob", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[user], max_retries=0, timeout=300, **kwargs)

    def auth(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[user]}"}

    def metrics(self) -> dict:
        r = httpx.get(f"{self.url}/metrics/engine", headers=self.auth("bob"), timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Counters at rest: nothing running or waiting, no KV block referenced, no token being made."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            m = self.metrics()
            e = m["engine"]
            idle = e["num_running"] == 0 and e["num_waiting"] == 0 and e["num_kv_blocks_used"] == 0 \
                and m["admission"]["in_flight"] == 0
            if idle and last is not None and last["num_generated_tokens"] == e["num_generated_tokens"]:
                return m
            last = e if idle else None
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
            time.sleep(0.2)


def prepare_home(home: Path, corpus: Path, model_cache: Path) -> dict[str, str]:
    """Ingest the sample corpus (and its imaging part as a second collection); register users; make keys."""
    shutil.copytree(LAB_DOCS, corpus / "lab-docs")
    shutil.copytree(LAB_DOCS / "imaging", corpus / "imaging-only")
    rag = make_rag(home, model_cache)
    try:
        assert rag.ingest([corpus / "lab-docs"]).ok
        assert rag.ingest([corpus / "imaging-only"], collection="imaging-notes").ok
        for user, groups in DEMO_USERS.items():
            rag.identity.add_user(user, groups)
        keys = {"bob": rag.identity.create_key("bob", ["imaging"]),
                "bob2": rag.identity.create_key("erin", ["imaging"]),
                "dave": rag.identity.create_key("dave", [])}
        keys["revoked"] = rag.identity.create_key("dave", [], label="to revoke")
        rag.identity.revoke_key(next(k.key_id for k in rag.identity.list_keys() if k.label == "to revoke"))
    finally:
        rag.close()
    return keys


@contextlib.contextmanager
def running_service(home: Path, keys: dict[str, str], env_overrides: dict[str, str]) -> Iterator[Service]:
    """`rag serve` in a subprocess on a free port, ready (GET /readyz 200); stopped at the end."""
    port = free_port()
    env = {**os.environ, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "RAG_DEVICE": "cpu", **env_overrides}
    log = home / f"serve-{port}.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "rag.cli", "serve", "--port", str(port)], cwd=REPO,
                                   env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, f"rag serve exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"rag serve not ready:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield Service(url, keys, process, log, home)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
