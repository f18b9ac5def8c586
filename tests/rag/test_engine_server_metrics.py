"""`rag engine serve` for operators: GET /metrics (Prometheus), `return_token_ids`, and `--engine-arg`."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rag.errors import ConfigError

if TYPE_CHECKING:
    from tests.rag.engine_server_fixture import EngineServer

pytest_plugins = ["tests.rag.engine_server_fixture"]


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# --- in process, a tiny random model without a tokenizer (fast) -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_http(tmp_path_factory):
    from fastapi.testclient import TestClient

    from generation.config import EngineConfig
    from generation.engine.async_engine import AsyncLLMEngine
    from rag.engine_server import create_engine_app
    from tests.generation.conftest import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-no-tokenizer")
    build_tiny_model(path)  # no tokenizer files: token-id prompts only, and no text to stream
    engine = AsyncLLMEngine.from_model(path, EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=2))
    app = create_engine_app(engine, "tiny", "k", owns_engine=True)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


AUTH = {"Authorization": "Bearer k"}
PROMPT = list(range(5, 25))


def test_a_stream_with_return_token_ids_carries_every_token_even_without_text(tiny_http):
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    events = sse_events(tiny_http.post("/v1/completions", json=body, headers=AUTH).text)
    ids = [i for e in events for c in e["choices"] for i in c.get("token_ids", [])]
    assert len(ids) == 6 == events[-1]["usage"]["completion_tokens"]
    assert sum(1 for e in events for c in e["choices"] if c.get("token_ids")) == 6  # one step, one token on CPU
    plain = tiny_http.post("/v1/completions", json={**body, "stream": False}, headers=AUTH).json()
    assert plain["choices"][0]["token_ids"] == ids  # greedy: the same tokens, all at once
    # Without the field nothing changes: no token ids, and a model without a tokenizer streams no text chunks.
    events = sse_events(tiny_http.post("/v1/completions", json={**body, "return_token_ids": False},
                                       headers=AUTH).text)
    assert not any("token_ids" in c for e in events for c in e["choices"])
    assert [c["finish_reason"] for e in events for c in e["choices"]] == ["length"]


def test_metrics_need_no_key_and_count_each_first_token(tiny_http):
    before = scrape(tiny_http.get("/metrics").text)
    for _ in range(3):
        r = tiny_http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200, r.text
    after = scrape(tiny_http.get("/metrics").text)
    count = ("rag_engine_time_to_first_token_seconds_count", ())
    assert after[count] - before[count] == 3
    assert after[("rag_engine_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == after[count]
    assert after[("rag_engine_num_requests_waiting", ())] == 0
    assert after[("rag_engine_kv_cache_usage_ratio", ())] == 0.0
    assert after[("rag_engine_request_success_total", ())] - before[("rag_engine_request_success_total", ())] == 3


# --- `--engine-arg KEY=VALUE` ---------------------------------------------------------------------------------

def test_engine_args_take_each_fields_type():
    from rag.cli.engine import parse_engine_args

    got = parse_engine_args(["quantization=fp8", "kv_cache_dtype=fp8", "max_num_seqs=128", "enforce_eager=true",
                             "gpu_memory_utilization=0.8", "max-model-len=4096", "num_kv_blocks=none"])
    assert got == {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_num_seqs": 128, "enforce_eager": True,
                   "gpu_memory_utilization": 0.8, "max_model_len": 4096, "num_kv_blocks": None}
    for bad, words in (("max_num_seqs", "KEY=VALUE"), ("nonsense=1", "no field 'nonsense'"),
                       ("max_num_seqs=lots", "takes a int"), ("enforce_eager=maybe", "true or false")):
        with pytest.raises(ConfigError, match=words):
            parse_engine_args([bad])


def test_cli_refuses_an_engine_arg_it_also_has_as_an_option(tmp_path):
    from typer.testing import CliRunner

    from rag.cli.main import app

    result = CliRunner().invoke(app, ["--home", str(tmp_path), "engine", "serve", "default", "--max-num-seqs", "4",
                                      "--engine-arg", "max_num_seqs=8"])
    assert isinstance(result.exception, ConfigError) and "max_num_seqs" in str(result.exception)


def test_cli_takes_the_step_budget_from_the_settings_and_an_engine_arg_over_it(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rag.cli.main import app

    # A budget below max_num_seqs is refused before any model loads: the refusal shows which value won.
    monkeypatch.setenv("RAG_ENGINE_MAX_NUM_BATCHED_TOKENS", "16")
    result = CliRunner().invoke(app, ["--home", str(tmp_path), "engine", "serve", "default", "--max-num-seqs", "32"])
    assert isinstance(result.exception, ConfigError) and "max_num_batched_tokens (16)" in str(result.exception)
    result = CliRunner().invoke(app, ["--home", str(tmp_path), "engine", "serve", "default", "--max-num-seqs", "32",
                                      "--engine-arg", "max_num_batched_tokens=24"])
    assert isinstance(result.exception, ConfigError) and "max_num_batched_tokens (24)" in str(result.exception)


# --- the real server: what an autoscaler scrapes while requests are in flight ----------------------------------

@pytest.mark.slow
def test_metrics_show_waiting_and_kv_usage_under_load_and_a_ttft_per_request(engine_server: EngineServer):
    # The session's server runs max_num_seqs=4: eight concurrent requests leave four waiting.
    engine_server.wait_idle()
    url = f"{engine_server.root_url}/metrics"
    before = scrape(httpx.get(url, timeout=10).text)
    n = 8
    body = {"model": engine_server.model, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True,
            "stream": True}
    done: list[int] = []

    def send() -> None:
        with httpx.stream("POST", f"{engine_server.base_url}/completions", json=body, headers=engine_server.auth,
                          timeout=300) as r:
            r.read()
            done.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    peak_waiting, peak_usage = 0.0, 0.0
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        now = scrape(httpx.get(url, timeout=10).text)
        peak_waiting = max(peak_waiting, now[("rag_engine_num_requests_waiting", ())])
        peak_usage = max(peak_usage, now[("rag_engine_kv_cache_usage_ratio", ())])
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=300)
    assert done == [200] * n
    engine_server.wait_idle()
    after = scrape(httpx.get(url, timeout=10).text)
    assert peak_waiting >= 1 and 0 < peak_usage <= 1
    assert after[("rag_engine_num_requests_waiting", ())] == 0 and after[("rag_engine_num_requests_running", ())] == 0
    assert after[("rag_engine_kv_cache_usage_ratio", ())] == 0
    count = ("rag_engine_time_to_first_token_seconds_count", ())
    assert after[count] - before[count] == n
    success = ("rag_engine_request_success_total", ())
    assert after[success] - before[success] == n
