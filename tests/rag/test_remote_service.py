"""`rag serve` generating on a remote OpenAI server: our own `rag engine serve`, both real subprocesses.

The service talks to the generator only through the Generator protocol; here that is the
RemoteGenerator over HTTP. The engine server's counters show that the answers were made there,
and that the per-user cache salt keeps one user's KV from another's on that server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.rag.serve_fixture import Service, prepare_home, running_service

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from tests.rag.engine_server_fixture import EngineServer

pytest_plugins = ["tests.rag.engine_server_fixture"]

QUESTION = "Which Slurm reservation does the imaging group have on the GPU nodes?"


@pytest.fixture(scope="module")
def remote_service(tmp_path_factory, model_cache, engine_server: EngineServer) -> Iterator[Service]:
    home = tmp_path_factory.mktemp("remote-serve-home")
    keys = prepare_home(home, tmp_path_factory.mktemp("remote-corpus"), model_cache)
    key_file = home / "generator.key"
    key_file.write_text(engine_server.api_key + "\n")
    key_file.chmod(0o600)
    env = {"RAG_GENERATOR_BACKEND": "remote", "RAG_GENERATOR_URL": engine_server.base_url,
           "RAG_GENERATOR_API_KEY_FILE": str(key_file), "RAG_MAX_NEW_TOKENS": "12", "RAG_TOP_K": "3"}
    with running_service(home, keys, env) as service:
        yield service


def _ask(service: Service, user: str, **kwargs):
    return service.client(user).chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], **kwargs)


def test_answers_come_from_the_remote_engine_with_citations(remote_service, engine_server):
    engine_server.wait_idle()
    before = engine_server.metrics()["num_requests_finished"]
    r = _ask(remote_service, "bob")
    assert r.choices[0].message.content.strip() and r.usage.completion_tokens > 0
    assert any("gpu-reservation" in c["source"] for c in r.model_extra["citations"])
    text = ""
    for chunk in _ask(remote_service, "bob", stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text.strip()
    engine_server.wait_idle()
    assert engine_server.metrics()["num_requests_finished"] == before + 2
    log = remote_service.log.read_text()
    assert engine_server.api_key not in log


def test_the_remote_cache_is_salted_per_user(remote_service, engine_server):
    def hits(user: str) -> int:
        engine_server.wait_idle()
        before = engine_server.metrics()["prefix_cache_hit_tokens"]
        _ask(remote_service, user, max_tokens=2)
        engine_server.wait_idle()
        return engine_server.metrics()["prefix_cache_hit_tokens"] - before

    hits("bob")
    assert hits("bob") > 100        # bob's own prompt again: his blocks are reused
    assert hits("bob2") == 0        # another user, same groups and prompt: nothing shared remotely


def test_readyz_follows_the_remote_server(remote_service):
    import httpx

    r = httpx.get(f"{remote_service.url}/readyz", timeout=10)
    assert r.status_code == 200 and r.json()["generator"] == "SmolLM2-135M-Instruct.Q4_1"
