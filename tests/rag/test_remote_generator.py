"""RemoteGenerator against a real `rag engine serve` subprocess: streaming, usage, cache salts, aborts, failures."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from typing import TYPE_CHECKING

import pytest

from rag.errors import ConfigError, GenerationError, GeneratorUnavailable
from rag.generator import GenerationDone, GenerationParams, GenerationRequest, Generator, TextDelta
from rag.generators import RemoteGenerator, make_remote_generator
from rag.settings import load_settings

if TYPE_CHECKING:
    from tests.rag.engine_server_fixture import EngineServer

# One registration of the fixture module: both test modules then share one server for the session.
pytest_plugins = ["tests.rag.engine_server_fixture"]

# Tests taking `engine_server` are slow: one SmolLM2 server subprocess for the session (shared with
# test_engine_server); the others need no server.

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def remote(server: EngineServer, **kwargs) -> RemoteGenerator:
    return RemoteGenerator(server.base_url, api_key=kwargs.pop("api_key", server.api_key), **kwargs)


async def collect(gen: RemoteGenerator, request: GenerationRequest) -> list:
    return [event async for event in gen.stream(request)]


@pytest.mark.slow
def test_streams_text_then_one_done_with_usage(engine_server):
    async def main():
        gen = remote(engine_server)
        try:
            assert isinstance(gen, Generator)
            events = await collect(gen, GenerationRequest(QUESTION, GenerationParams(max_tokens=8)))
            return gen.model_name, events
        finally:
            await gen.aclose()

    model, events = asyncio.run(main())
    assert model == engine_server.model  # learnt from GET /models
    *deltas, done = events
    assert deltas and all(isinstance(e, TextDelta) and e.text for e in deltas)
    assert isinstance(done, GenerationDone) and done.finish_reason in ("stop", "length")
    assert done.prompt_tokens > 5 and 0 < done.completion_tokens <= 8
    assert done.time_to_first_token is not None and done.time_to_first_token > 0
    assert "".join(d.text for d in deltas).strip()


@pytest.mark.slow
def test_readiness_probe(engine_server):
    async def main():
        gen, dead = remote(engine_server), RemoteGenerator(f"http://127.0.0.1:{_free_port()}/v1")
        try:
            before = gen.is_ready()  # nothing probed yet: not known to be ready
            return before, await gen.check_ready(), gen.is_ready(), gen.model_name, await dead.check_ready()
        finally:
            await gen.aclose()
            await dead.aclose()

    before, probed, after, model, dead = asyncio.run(main())
    assert (before, probed, after, dead) == (False, True, True, False)
    assert model == engine_server.model


@pytest.mark.slow
def test_cache_salt_reaches_the_server(engine_server):
    # A prompt of several KV blocks that no other test sends: hits can only come from these requests.
    topic = uuid.uuid4().hex
    messages = [{"role": "user", "content": f"Notes {topic}: " + "the freezer in room 204 is kept at -80 C. " * 6
                 + "Where is the freezer?"}]

    def hits(gen: RemoteGenerator, salt: str) -> int:
        before = engine_server.wait_idle()["prefix_cache_hit_tokens"]
        request = GenerationRequest(messages, GenerationParams(max_tokens=2), user_salt=salt)
        done = asyncio.run(collect(gen, request))[-1]
        assert isinstance(done, GenerationDone)
        return engine_server.wait_idle()["prefix_cache_hit_tokens"] - before

    salted, unsalted = remote(engine_server, cache_salt="user"), remote(engine_server, cache_salt="off")
    alice, bob = f"alice-{topic}", f"bob-{topic}"
    assert hits(salted, alice) == 0  # first in alice's namespace
    assert hits(salted, alice) >= 32  # the same salt shares the prompt's full blocks
    assert hits(salted, bob) == 0  # another salt sees none of them
    # "off" sends no salt: every user lands in the one unsalted namespace, which shares (the chat
    # template's head is cached there already by other tests' unsalted requests, hence `first`).
    first = hits(unsalted, alice)
    assert hits(unsalted, bob) >= first + 32


@pytest.mark.slow
def test_closing_the_stream_early_aborts_the_request(engine_server):
    before = engine_server.wait_idle()

    async def main():
        gen = remote(engine_server)
        stream = gen.stream(GenerationRequest([{"role": "user", "content": "Tell me a very long story about ships."}],
                                              GenerationParams(max_tokens=1500)))
        got = 0
        async for event in stream:
            assert isinstance(event, TextDelta)
            got += 1
            if got == 3:
                break
        await asyncio.to_thread(engine_server.wait_busy)  # still generating while we hold the stream
        await stream.aclose()
        await gen.aclose()

    asyncio.run(main())
    after = engine_server.wait_idle()
    assert after["num_requests_finished"] == before["num_requests_finished"]  # aborted, not finished
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < 1500


def test_dead_url_is_unavailable_quickly():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    gen = RemoteGenerator(url, model="m", api_key="sk-dead-5551212")
    started = time.monotonic()
    with pytest.raises(GeneratorUnavailable) as e:
        asyncio.run(collect(gen, GenerationRequest(QUESTION)))
    assert time.monotonic() - started < 5
    assert url in str(e.value) and "sk-dead-5551212" not in str(e.value)
    assert not gen.is_ready()


@pytest.mark.slow
def test_wrong_key_is_a_clear_error_without_the_key(engine_server, caplog):
    secret = "sk-wrong-" + uuid.uuid4().hex
    caplog.set_level(logging.DEBUG)  # httpx and httpcore included

    async def main():
        gen = remote(engine_server, api_key=secret)
        try:
            ready = await gen.check_ready()
            with pytest.raises(GenerationError) as e:
                await collect(gen, GenerationRequest(QUESTION))
            # With the model named, the 401 comes from POST /chat/completions instead of GET /models.
            named = RemoteGenerator(engine_server.base_url, model=engine_server.model, api_key=secret)
            with pytest.raises(GenerationError) as e2:
                await collect(named, GenerationRequest(QUESTION))
            await named.aclose()
            return ready, e.value, e2.value
        finally:
            await gen.aclose()

    ready, error, error2 = asyncio.run(main())
    assert ready is False
    for err in (error, error2):
        assert not isinstance(err, GeneratorUnavailable)  # the server is up; the key is wrong
        assert "401" in str(err) and "key" in str(err) and engine_server.base_url in str(err)
        assert secret not in str(err) and secret not in repr(err.args)
    assert caplog.records and secret not in caplog.text


@pytest.mark.slow
def test_refused_request_carries_the_servers_message(engine_server):
    gen = remote(engine_server, model=engine_server.model)
    with pytest.raises(GenerationError) as e:
        asyncio.run(collect(gen, GenerationRequest(QUESTION, GenerationParams(max_tokens=100000))))
    assert not isinstance(e.value, GeneratorUnavailable)
    assert "400" in str(e.value) and "max_tokens" in str(e.value)


@pytest.mark.slow
def test_factory_reads_the_settings(engine_server, tmp_path, monkeypatch):
    for name in ("RAG_GENERATOR_URL", "RAG_GENERATOR_MODEL", "RAG_GENERATOR_API_KEY", "RAG_GENERATOR_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="generator_url"):
        make_remote_generator(load_settings(home=tmp_path))
    key_file = tmp_path / "key"
    key_file.write_text(engine_server.api_key + "\n")
    settings = load_settings(home=tmp_path, generator_url=engine_server.base_url, generator_model=engine_server.model,
                             generator_api_key_file=key_file, generator_cache_salt="off", generator_timeout=30)
    gen = make_remote_generator(settings)
    assert (gen.model_name, gen.cache_salt, gen.timeout) == (engine_server.model, "off", 30)
    done = asyncio.run(collect(gen, GenerationRequest(QUESTION, GenerationParams(max_tokens=2))))[-1]
    assert isinstance(done, GenerationDone) and done.completion_tokens > 0


def test_count_tokens_is_an_estimate():
    gen = RemoteGenerator("http://127.0.0.1:9/v1", model="m")
    assert gen.count_tokens("") == 0
    assert gen.count_tokens("x" * 35) == 10
    with pytest.raises(ConfigError):
        RemoteGenerator("gpu01:8000/v1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
