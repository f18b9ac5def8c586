"""`rag engine serve`: the OpenAI API over our engine, checked with the official `openai` client on a real server."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from tests.rag.live_server import serving
from tests.rag.raw_http import raw_request

if TYPE_CHECKING:
    from tests.rag.engine_server_fixture import EngineServer

# One registration of the fixture module: both test modules then share one server for the session.
pytest_plugins = ["tests.rag.engine_server_fixture"]

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(engine_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.base_url, api_key=engine_server.api_key, max_retries=0, timeout=120)


# --- the real server (SmolLM2 on CPU, one subprocess for the session) ----------------------------------------


@pytest.mark.slow
def test_lists_its_one_model(client, engine_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine_server.model]
    assert models.data[0].object == "model"
    assert client.models.retrieve(engine_server.model).id == engine_server.model


@pytest.mark.slow
def test_chat_completion_with_usage(client, engine_server):
    out = client.chat.completions.create(
        model=engine_server.model, messages=QUESTION, max_tokens=8, temperature=0,
        extra_body={"some_future_field": {"x": 1}, "user": "alice"},  # unknown fields are ignored
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == engine_server.model
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 5 and 0 < out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


@pytest.mark.slow
def test_chat_stream_matches_the_plain_answer(client, engine_server):
    plain = client.chat.completions.create(model=engine_server.model, messages=QUESTION, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=engine_server.model, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy: the same tokens either way
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [plain.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == plain.usage.completion_tokens
    # Without include_usage no usage chunk is sent.
    chunks = list(client.chat.completions.create(
        model=engine_server.model, messages=QUESTION, max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


@pytest.mark.slow
def test_text_parts_and_system_messages(client, engine_server):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital of France? "},
                                             {"type": "text", "text": "Answer in one word."}]}]
    out = client.chat.completions.create(model=engine_server.model, messages=messages, max_tokens=6, temperature=0)
    assert out.choices[0].message.content.strip()


@pytest.mark.slow
def test_completions_text_ids_and_stream(client, engine_server):
    out = client.completions.create(model=engine_server.model, prompt="The three primary colors are", max_tokens=8,
                                    temperature=0)
    assert out.choices[0].text.strip() and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
    ids = client.completions.create(model=engine_server.model, prompt=[504, 1342, 3255, 2887, 359], max_tokens=4)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=engine_server.model, prompt="The three primary colors are",
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


@pytest.mark.slow
def test_seed_and_stop(client, engine_server):
    def sample(seed: int) -> str:
        out = client.completions.create(model=engine_server.model, prompt="Once upon a time", max_tokens=10,
                                        temperature=1.0, seed=seed)
        return out.choices[0].text

    # At temperature 1, where a seed matters: the same seed, the same text; other seeds, other text.
    first = sample(7)
    assert first and sample(7) == first
    assert {sample(seed) for seed in (8, 9, 10)} - {first}
    out = client.chat.completions.create(model=engine_server.model, messages=QUESTION, max_tokens=12,
                                         temperature=0, stop=["Paris", "paris"])
    assert "aris" not in out.choices[0].message.content


@pytest.mark.slow
def test_wrong_or_missing_key_is_401(engine_server):
    bad = openai.OpenAI(base_url=engine_server.base_url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=engine_server.model, messages=QUESTION, max_tokens=2)
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}):
        r = httpx.post(f"{engine_server.base_url}/chat/completions", headers=headers, content=b"{not json")
        assert r.status_code == 401, headers  # the key is checked before the body is looked at
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{engine_server.root_url}/metrics/engine").status_code == 401
    assert httpx.get(f"{engine_server.root_url}/health").status_code == 200  # open, for load balancers


BAD_BODIES = [
    ("malformed JSON", b'{"messages": [', None),
    ("non-UTF-8 body", b'{"messages": "\xff\xfe"}', None),
    ("not an object", b"[1, 2]", None),
    ("empty messages", json.dumps({"messages": []}).encode(), "messages"),
    ("no messages", json.dumps({"max_tokens": 4}).encode(), "messages"),
    ("wrong role", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "messages"),
    ("content a number", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "messages"),
    ("image part", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}).encode(), "messages"),
    ("max_tokens 0", json.dumps({"messages": QUESTION, "max_tokens": 0}).encode(), "max_tokens"),
    ("max_tokens -1", json.dumps({"messages": QUESTION, "max_tokens": -1}).encode(), "max_tokens"),
    ("max_tokens past the context", json.dumps({"messages": QUESTION, "max_tokens": 100000}).encode(), "max_tokens"),
    ("max_tokens a string", json.dumps({"messages": QUESTION, "max_tokens": "8"}).encode(), "max_tokens"),
    ("temperature too high", json.dumps({"messages": QUESTION, "temperature": 9}).encode(), "temperature"),
    ("n = 2", json.dumps({"messages": QUESTION, "n": 2, "max_tokens": 2}).encode(), "n"),
    ("empty stop", json.dumps({"messages": QUESTION, "stop": [""]}).encode(), "stop"),
    ("empty cache_salt", json.dumps({"messages": QUESTION, "cache_salt": ""}).encode(), "cache_salt"),
    ("prompt longer than the context",
     json.dumps({"messages": [{"role": "user", "content": "hello " * 2100}]}).encode(), "messages"),
]


@pytest.mark.slow
def test_bad_requests_are_openai_shaped_400s_and_the_server_goes_on(client, engine_server):
    url = f"{engine_server.base_url}/chat/completions"
    for name, body, param in BAD_BODIES:
        r = httpx.post(url, content=body, headers={**engine_server.auth, "Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["type"] == "invalid_request_error" and error["message"], name
        assert "Traceback" not in error["message"], name
        if param is not None:  # the field's path: "messages" or "messages.0.role"
            assert error["param"].split(".")[0] == param, (name, error)
    long_ids = {"prompt": [100] * 2100, "max_tokens": 2}
    r = httpx.post(f"{engine_server.base_url}/completions", json=long_ids, headers=engine_server.auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{engine_server.base_url}/completions", json={"prompt": [49152]}, headers=engine_server.auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # out of the vocabulary
    # Through the client: typed exceptions by status.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=engine_server.model, messages=QUESTION, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=engine_server.model, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=QUESTION, max_tokens=2)
    assert e.value.status_code == 404 and "gpt-17" not in e.value.message  # never quoted back
    assert engine_server.model in e.value.message
    assert httpx.get(f"{engine_server.base_url}/nowhere", headers=engine_server.auth).json()["error"]["message"]
    # Still serving, and nothing was left in the engine.
    out = client.chat.completions.create(model=engine_server.model, messages=QUESTION, max_tokens=2)
    assert out.usage.completion_tokens > 0
    engine_server.wait_idle()


def _start_long_stream(engine_server: EngineServer, http: httpx.Client, kind: str):
    body = {"max_tokens": 1500, "ignore_eos": True, "stream": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me a very long story."}]
    else:
        body["prompt"] = "Once upon a time"
    return http.stream("POST", f"{engine_server.base_url}/{'chat/' if kind == 'chat' else ''}completions",
                       json=body, headers=engine_server.auth)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_client_that_disconnects_mid_stream_frees_its_request(engine_server, kind):
    before = engine_server.wait_idle()
    with httpx.Client(timeout=60) as http, _start_long_stream(engine_server, http, kind) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: {")
            if events == 4:
                # Still inside the iteration: leaving it closes the connection (httpx closes the stream).
                engine_server.wait_busy()
                break
    # The response is closed: the engine must drop the request (1500 tokens would take minutes).
    after = engine_server.wait_idle()
    assert after["num_requests_finished"] == before["num_requests_finished"]  # aborted, not finished
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < 1500


@pytest.mark.slow
def test_client_that_gives_up_on_a_plain_request_frees_it(engine_server):
    before = engine_server.wait_idle()
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine_server.base_url}/completions", json=body, headers=engine_server.auth, timeout=2.0)
    after = engine_server.wait_idle()
    assert after["num_requests_finished"] == before["num_requests_finished"]
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < 1500


# --- in process, over a tiny random model (fast) --------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from generation.config import EngineConfig
    from generation.engine.async_engine import AsyncLLMEngine
    from rag.engine_server import create_engine_app
    from tests.generation.conftest import build_tiny_model, save_char_tokenizer

    path = tmp_path_factory.mktemp("tiny-engine")
    build_tiny_model(path)
    save_char_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    engine = AsyncLLMEngine.from_model(path, EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=2))
    app = create_engine_app(engine, "tiny", "k", owns_engine=True)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield engine, http


def test_tiny_server_generates(tiny_app):
    engine, http = tiny_app
    auth = {"Authorization": "Bearer k"}
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 3}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 or r.json()["choices"][0]["finish_reason"] == "stop"
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True}, headers=auth)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    assert http.get("/v1/models").status_code == 401


def test_dead_engine_answers_503(tiny_app):
    engine, http = tiny_app
    auth = {"Authorization": "Bearer k"}
    assert http.get("/health").status_code == 200
    engine.shutdown()
    deadline = time.monotonic() + 10
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"]
    for path, body in (("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "abc", "max_tokens": 2, "stream": True})):
        r = http.post(path, json=body, headers=auth)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"]["code"] == "engine_dead"
    assert http.get("/metrics/engine", headers=auth).json()["is_running"] is False


def test_cli_refuses_two_keys(tmp_path):
    from typer.testing import CliRunner

    from rag.cli.main import app
    from rag.errors import ConfigError

    key_file = tmp_path / "key"
    key_file.write_text("abc\n")
    result = CliRunner().invoke(app, ["--home", str(tmp_path), "engine", "serve", "default", "--api-key", "x",
                                      "--api-key-file", str(key_file)])
    assert isinstance(result.exception, ConfigError), result.output


# --- bad requests over real HTTP, on the tiny model (fast) ----------------------------------------------------

SMALL_CAP = 32 * 1024


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    from transformers import AutoTokenizer

    from generation.config import EngineConfig
    from generation.engine.async_engine import AsyncLLMEngine
    from rag.engine_server import create_engine_app
    from tests.generation.conftest import build_tiny_model, save_char_tokenizer
    path = tmp_path_factory.mktemp("tiny-engine-http")
    build_tiny_model(path)
    save_char_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    engine = AsyncLLMEngine.from_model(path, EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=2))
    app = create_engine_app(engine, "tiny", "k", owns_engine=True, max_body_bytes=SMALL_CAP)
    with serving(app) as url:
        yield url


@pytest.mark.parametrize("auth, status", [(None, 401), ("Bearer k", 413)])
def test_engine_server_never_waits_for_a_body_past_its_cap(tiny_served, auth, status):
    head = ["POST /v1/chat/completions HTTP/1.1", "Content-Type: application/json", "Content-Length: 50000000"]
    if auth:
        head.append(f"Authorization: {auth}")
    # Declared, never sent: only a server that answers without reading it can answer at all.
    got, body = raw_request(tiny_served, head)
    assert got == status and set(body["error"]) == {"message", "type", "param", "code"}


def test_engine_server_refuses_a_chunked_body_once_past_its_cap(tiny_served):
    piece = b"x" * 8192
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(SMALL_CAP // len(piece) + 1))
    got, body = raw_request(tiny_served, ["POST /v1/completions HTTP/1.1", "Authorization: Bearer k",
                                                  "Content-Type: application/json", "Transfer-Encoding: chunked"],
                                    chunks)
    assert got == 413 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("temperature", "0.5"), ("temperature", True), ("stream", 1),
                                          ("max_tokens", 2.0), ("seed", 2**70), ("top_k", 10**9),
                                          ("stop", ["s"] * 17), ("cache_salt", "s" * 300)])
def test_engine_server_fields_are_strict(tiny_served, field, value):
    r = httpx.post(f"{tiny_served}/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                   json={"messages": QUESTION, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_engine_server_quotes_nothing_back(tiny_served):
    marker = "zqxj-secret-marker"
    auth = {"Authorization": "Bearer k"}
    responses = [
        httpx.post(f"{tiny_served}/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": marker, "messages": QUESTION, "max_tokens": 2}),
        httpx.get(f"{tiny_served}/v1/{marker}", headers=auth, timeout=60),
        httpx.post(f"{tiny_served}/v1/completions", headers=auth, timeout=60,
                   json={"prompt": "abc", marker: 1, "max_tokens": "x" + marker}),
        httpx.post(f"{tiny_served}/v1/completions", headers=auth, timeout=60,
                   content=b'{"prompt": NaN, "x": "' + marker.encode() + b'"}'),
    ]
    assert [r.status_code for r in responses] == [404, 404, 400, 400]
    for r in responses:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and marker not in r.text
    assert "tiny" in responses[0].json()["error"]["message"]  # it names what it serves instead
