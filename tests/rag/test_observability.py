"""Observability over real HTTP: GET /metrics moves by exactly the requests made, request ids go in
and out, JSON log lines parse and carry them, and neither says what was asked, answered or by whom.

The service runs in this process (uvicorn in a thread, the packaged models on the CPU) so that the
test can capture its log records.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from rag.api.app import create_app
from rag.api.logs import JsonFormatter
from tests.rag.live_server import serving

REPO = Path(__file__).resolve().parents[2]

QUESTION = "Which GPU nodes can I use?"
CHAT_QUESTION = "How do I submit a job to the GPU partition?"
RETRIEVAL_HISTOGRAMS = ("rag_retrieval_embed_seconds", "rag_retrieval_search_seconds",
                        "rag_retrieval_keyword_seconds", "rag_retrieval_rerank_seconds", "rag_request_seconds")
ENGINE_GAUGES = ("rag_engine_num_requests_running", "rag_engine_num_requests_waiting", "rag_engine_kv_blocks_used",
                 "rag_engine_kv_blocks_free", "rag_engine_prefix_cache_hit_rate")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def live(lab_rag):
    settings = lab_rag.settings.model_copy(update={
        "device": "cpu", "max_new_tokens": 8, "engine_num_kv_blocks": 256, "engine_max_num_seqs": 2,
        "top_k": 2, "request_timeout": 120.0,
        "answer_mode": "generate"})  # the engine's path (the packaged model would answer by extraction)
    captured = _Lines()
    root, rag_logger = logging.getLogger(), logging.getLogger("rag")
    old_level = rag_logger.level
    root.addHandler(captured)
    rag_logger.setLevel(logging.INFO)  # every rag.* INFO line is checked for leaks too
    app = create_app(settings)
    key = lab_rag.identity.create_key("bob", ["imaging"])
    with serving(app) as url:
        yield url, key, captured
    root.removeHandler(captured)
    rag_logger.setLevel(old_level)


def _scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(r.text) for s in family.samples}
    return r.text, samples


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _access_lines(captured: _Lines) -> list[dict]:
    records = [json.loads(line) for line in captured.lines]  # every line parses
    return [r for r in records if r["logger"] == "rag.access"]


@pytest.mark.slow
def test_metrics_request_ids_and_json_logs(live):
    url, key, captured = live
    auth = {"Authorization": f"Bearer {key}"}
    _, before = _scrape(url)
    n_lines = len(captured.lines)

    chat = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={**auth, "X-Request-ID": "trace-42.a_B"},
                      json={"model": "default", "messages": [{"role": "user", "content": CHAT_QUESTION}]})
    assert chat.status_code == 200 and chat.headers["x-request-id"] == "trace-42.a_B"
    completion_tokens = chat.json()["usage"]["completion_tokens"]
    assert completion_tokens > 0

    query = httpx.post(f"{url}/v1/query", headers=auth, timeout=300, json={"question": QUESTION, "generate": False})
    assert query.status_code == 200
    generated_id = query.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated_id)
    citations = query.json()["citations"]
    assert citations

    too_long = "a" * 129
    for bad in ("has space", "semi;colon", too_long):
        unauthorized = httpx.post(f"{url}/v1/query", headers={"X-Request-ID": bad}, timeout=30,
                                  json={"question": QUESTION})
        assert unauthorized.status_code == 401
        replaced = unauthorized.headers["x-request-id"]
        assert replaced != bad and re.fullmatch(r"[0-9a-f]{32}", replaced)
    missing = httpx.get(f"{url}/no/such/route-with-secret", timeout=30)
    assert missing.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", missing.headers["x-request-id"])
    document = httpx.get(f"{url}/v1/documents/default/no-such-chunk", headers=auth, timeout=30)
    doc_status = document.status_code

    body, after = _scrape(url)
    requests_by_labels = {
        ("/v1/chat/completions", "POST", "200"): 1,
        ("/v1/query", "POST", "200"): 1,
        ("/v1/query", "POST", "401"): 3,
        ("unmatched", "GET", "404"): 1,
        ("/v1/documents/{collection}/{chunk_id}", "GET", str(doc_status)): 1,
        ("/metrics", "GET", "200"): 1,  # the first scrape (this one is counted once it is sent)
    }
    for (route, method, status), n in requests_by_labels.items():
        assert _delta(before, after, "rag_requests_total", route=route, method=method, status=status) == n
    total = sum(v for (name, _), v in after.items() if name == "rag_requests_total") \
        - sum(v for (name, _), v in before.items() if name == "rag_requests_total")
    assert total == sum(requests_by_labels.values())  # nothing else moved

    # Two answers finished (the chat one generated, the query one did not).
    for name in RETRIEVAL_HISTOGRAMS:
        assert _delta(before, after, f"{name}_count") == 2, name
        assert _delta(before, after, f"{name}_sum") > 0, name
    for name in ("rag_request_queue_seconds", "rag_time_to_first_token_seconds", "rag_generation_seconds"):
        assert _delta(before, after, f"{name}_count") == 1, name
    assert _delta(before, after, "rag_generated_tokens_total") == completion_tokens
    assert _delta(before, after, "rag_http_request_duration_seconds_count", route="/v1/query", method="POST") == 4

    # The local generator is loaded: its gauges are there, and its counters moved with the chat answer.
    for name in ENGINE_GAUGES:
        assert (name, ()) in after, name
    assert after[("rag_engine_num_requests_running", ())] == 0
    assert after[("rag_engine_kv_blocks_used", ())] + after[("rag_engine_kv_blocks_free", ())] == 256
    assert _delta(before, after, "rag_engine_generation_tokens_total") >= completion_tokens
    # A CPU engine runs one step per batch: nothing stops early, nothing is skipped, but both are there.
    assert after[("rag_engine_batches_stopped_early_total", ())] == 0
    assert after[("rag_engine_steps_skipped_total", ())] == 0
    assert after[("rag_admission_in_flight", ())] == 0 and after[("rag_admission_queued", ())] == 0
    assert ("rag_admission_rejections_total", ()) in after

    # No question, answer, document text, user or collection name in the metrics or the logs.
    answer_text = chat.json()["choices"][0]["message"]["content"]
    secrets = [QUESTION, CHAT_QUESTION, "bob", "imaging", "route-with-secret", "/v1/documents/default",
               *(c["text"][:40] for c in citations)]
    if len(answer_text) >= 12:
        secrets.append(answer_text[:40])
    log_text = "\n".join(captured.lines[n_lines:])
    for secret in secrets:
        assert secret not in body, secret
        assert secret not in log_text, secret
    assert 'collection="' not in body and 'user="' not in body

    # One access line per request, each with the id its response carried.
    access = _access_lines(captured)
    by_id = {r["request_id"]: r for r in access}
    chat_line = by_id["trace-42.a_B"]
    assert (chat_line["method"], chat_line["route"], chat_line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert by_id[generated_id]["route"] == "/v1/query" and by_id[generated_id]["status"] == 200
    assert by_id[replaced]["status"] == 401
    for record in access:
        assert set(record) >= {"time", "level", "logger", "message", "request_id", "method", "route", "status",
                               "duration_ms"}
        assert record["level"] == "INFO" and record["duration_ms"] >= 0


def test_metrics_can_be_turned_off_and_errors_carry_the_request_id(lab_rag, caplog):
    caplog.set_level(logging.INFO)
    app = create_app(lab_rag.settings.model_copy(update={"metrics_enabled": False}), preload=False)

    async def boom():
        detail = "secret " + "internal detail"  # built here: the logged stack shows source lines
        raise RuntimeError(detail)

    app.add_api_route("/boom", boom)

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            metrics = await client.get("/metrics")
            failed = await client.get("/boom", headers={"X-Request-ID": "boom-1"})
            return metrics, failed

    import asyncio

    metrics, failed = asyncio.run(run())
    assert metrics.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", metrics.headers["x-request-id"])
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "boom-1"
    assert failed.json() == {"error": {"message": "internal error", "type": "server_error", "param": None,
                                       "code": None}}
    # The error is logged with its type and where it was raised, never its message (which could
    # quote a request: a question, a document's text).
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert "RuntimeError" in logged and "boom" in logged
    assert "secret internal detail" not in caplog.text


def test_an_internal_error_over_real_http_logs_no_message(lab_rag, capfd):
    app = create_app(lab_rag.settings.model_copy(update={"device": "cpu"}), preload=False)

    async def boom():
        question = "what the user asked: " + "zqxj-secret-question"  # not in the source line of the stack
        raise RuntimeError(question)

    app.add_api_route("/boom", boom)
    with serving(app) as url:
        failed = httpx.get(f"{url}/boom", timeout=30)
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200  # still serving
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error"
    assert "zqxj" not in failed.text
    # Neither our log nor uvicorn's ("Exception in ASGI application" with the traceback) has the message.
    out, err = capfd.readouterr()
    assert "zqxj-secret-question" not in out + err


def test_serve_log_format_json_sets_up_json_logs(monkeypatch, tmp_path):
    import uvicorn as uvicorn_module

    import rag.api.app
    from rag.cli.main import app as cli

    seen = {}
    monkeypatch.setattr(rag.api.app, "create_app",
                        lambda settings, **options: seen.update(settings=settings, **options))  # fmt: skip
    monkeypatch.setattr(uvicorn_module, "run", lambda app, **kwargs: seen.update(kwargs))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(cli, ["--home", str(tmp_path), "serve", "--log-format", "json"])
        assert result.exit_code == 0, result.output
        assert seen["settings"].log_format == "json" and seen["access_log"] is False
        assert seen["freeze_heap"] is True  # a server process of its own: start-up objects leave the GC
        assert seen["log_config"]["loggers"]["uvicorn.error"]["propagate"] is True
        assert any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
        bad = CliRunner().invoke(cli, ["--home", str(tmp_path), "serve", "--log-format", "xml"])
        assert bad.exit_code != 0
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_the_service_log_has_no_faiss_cpu_probing():
    # Faiss logs each CPU build it fails to load ("Could not load library with AVX512 support due
    # to: ModuleNotFoundError(...)") at INFO: in an operator's log that reads like a failure.
    code = ("import logging; from rag.api.logs import configure_logging; configure_logging('text'); "
            "import faiss; logging.getLogger('rag').info('still logged')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "still logged" in done.stderr
    assert "Could not load library" not in done.stderr and "ModuleNotFoundError" not in done.stderr
