"""`rag query --server URL` against a real `rag serve` subprocess, and the API's relevance fields.

The CLI runs with an empty data directory of its own: everything it shows comes from the server,
as the key's user may see it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rag.query_client import ServerQueryError, load_hint, loading_dominates, query_server, response_to_dict
from tests.rag.serve_fixture import Service, free_port, prepare_home, running_service

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]
RESERVATION_Q = "Which Slurm reservation does the imaging group have on the GPU nodes?"


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache) -> Iterator[Service]:
    home = tmp_path_factory.mktemp("client-serve-home")
    keys = prepare_home(home, tmp_path_factory.mktemp("client-serve-corpus"), model_cache)
    env = {"RAG_MAX_NEW_TOKENS": "16", "RAG_TOP_K": "3", "RAG_ENGINE_NUM_KV_BLOCKS": "640"}
    with running_service(home, keys, env) as service:
        yield service


@pytest.fixture(scope="module")
def client_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("client-home")  # empty: no collections, no models, no keys


def _cli(args: list[str], home: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RAG_API_KEY", "RAG_API_KEY_FILE", "RAG_SERVER")}
    return subprocess.run(RAG + args, env={**base, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", **env},
                          capture_output=True, text=True, timeout=600)


def _ask(service: Service, home: Path, user: str, *extra: str) -> subprocess.CompletedProcess:
    return _cli(["query", RESERVATION_Q, "--server", service.url, *extra], home, RAG_API_KEY=service.keys[user])


def _error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert lines and "Traceback" not in r.stderr, r.stderr
    return lines[-1]


def test_the_server_answers_with_the_keys_view(service, client_home):
    bob = _ask(service, client_home, "bob", "--no-generate", "--json")
    dave = _ask(service, client_home, "dave", "--no-generate", "--json")
    assert bob.returncode == 0 and dave.returncode == 0, bob.stderr + dave.stderr
    bob_out, dave_out = json.loads(bob.stdout), json.loads(dave.stdout)
    assert bob_out["user"] == "bob" and dave_out["user"] == "dave"
    assert any("imaging" in c["source"] for c in bob_out["citations"]), bob_out["citations"]
    assert dave_out["citations"] and not any("imaging" in c["source"] for c in dave_out["citations"])
    assert not any("cryoem-res" in c["text"] for c in dave_out["citations"])
    # The local --json shape: raw score kept, relevance beside it; nothing was loaded or stored here.
    assert set(bob_out) == {"question", "user", "groups", "answer", "answer_mode", "citations", "timings_ms"}
    for c in bob_out["citations"]:
        assert set(c) == {"number", "source", "document", "chunk", "score", "relevance", "rank", "text"}
        assert c["relevance"] == pytest.approx(1 / (1 + math.exp(-c["score"])), abs=1e-3)
    assert bob_out["timings_ms"] is None  # stage timings are for admin keys only
    assert not (client_home / "catalog.sqlite").exists()


def test_human_output_shows_relevance_and_the_answer(service, client_home):
    r = _ask(service, client_home, "bob")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    cited = [line for line in lines if line.startswith("[")]
    assert cited and all("relevance 0." in line or "relevance 1.00" in line for line in cited), r.stdout
    assert lines[0].strip() and not lines[0].startswith("[")  # the answer comes first
    assert "hint:" not in r.stderr  # the server had the models loaded already


def test_key_from_a_private_file_and_a_warning_for_an_open_one(service, client_home, tmp_path):
    key_file = tmp_path / "bob.key"
    key_file.write_text(service.keys["bob"] + "\n")
    key_file.chmod(0o600)
    args = ["query", RESERVATION_Q, "--server", service.url, "--key-file", str(key_file), "--no-generate", "--json"]
    r = _cli(args, client_home)
    assert r.returncode == 0 and json.loads(r.stdout)["user"] == "bob", r.stderr
    assert "readable by other users" not in r.stderr
    key_file.chmod(0o644)
    r = _cli(args, client_home)
    assert r.returncode == 0 and "readable by other users" in r.stderr and "chmod 600" in r.stderr
    assert service.keys["bob"] not in r.stderr


def test_rag_server_env_names_the_server(service, client_home):
    r = _cli(["query", RESERVATION_Q, "--no-generate", "--json"], client_home,
             RAG_SERVER=service.url, RAG_API_KEY=service.keys["dave"])
    assert r.returncode == 0 and json.loads(r.stdout)["user"] == "dave", r.stderr


@pytest.mark.parametrize("user, args, code, words", [
    ("revoked", [], 2, "the server refused the key (401)"),
    ("bob", ["--collection", "no-such-collection"], 2, "not found (404)"),
    ("dave", ["--collection", "imaging-notes"], 2, "not found (404)"),  # unreadable answers as unknown
    ("bob", ["--k", "500"], 2, "refused the request (400)"),
])
def test_server_errors_are_one_line(service, client_home, user, args, code, words):
    r = _ask(service, client_home, user, "--no-generate", *args)
    assert r.returncode == code, r.stderr
    line = _error_line(r)
    assert line.startswith("error: ") and words in line, r.stderr
    if user == "dave":  # the same answer as for a collection that does not exist
        assert "imaging" not in line
    assert service.keys[user] not in r.stderr


def test_a_bad_key_says_so(service, client_home):
    r = _cli(["query", RESERVATION_Q, "--server", service.url], client_home, RAG_API_KEY="rag_not-a-real-key")
    assert r.returncode == 2 and "(401)" in _error_line(r) and "RAG_API_KEY" in _error_line(r)
    assert "rag_not-a-real-key" not in r.stderr


def test_an_unreachable_server(client_home):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = _cli(["query", "hi", "--server", url], client_home, RAG_API_KEY="rag_x")
    assert r.returncode == 1
    assert _error_line(r).startswith(f"error: cannot reach the server at {url}") and "rag serve" in r.stderr


@pytest.mark.parametrize("args, words", [
    (["--as", "bob"], "--as cannot be used with --server"),
    (["--group", "imaging"], "--group cannot be used with --server"),
    (["--no-rerank"], "--no-rerank cannot be used with --server"),
])
def test_local_only_flags_are_refused_with_server(client_home, args, words):
    r = _cli(["query", "hi", "--server", "http://127.0.0.1:9", *args], client_home, RAG_API_KEY="rag_x")
    assert r.returncode == 2 and words in _error_line(r), r.stderr


def test_no_key_and_no_user_are_usage_errors(client_home):
    r = _cli(["query", "hi", "--server", "http://127.0.0.1:9"], client_home)
    assert r.returncode == 2 and "RAG_API_KEY" in _error_line(r) and "--key-file" in _error_line(r)
    r = _cli(["query", "hi"], client_home)
    assert r.returncode == 2 and "--as USER" in _error_line(r) and "--server" in _error_line(r)


# ------------------------------------------------------------------ the API's relevance fields


def test_query_api_keeps_the_score_and_adds_relevance_and_rank(service):
    r = httpx.post(f"{service.url}/v1/query", headers=service.auth("bob"), timeout=120,
                   json={"question": RESERVATION_Q, "generate": False, "k": 3})
    assert r.status_code == 200, r.text
    citations = r.json()["citations"]
    assert citations
    for c in citations:
        assert c["relevance"] == pytest.approx(1 / (1 + math.exp(-c["score"])))
    assert sorted(c["rank"] for c in citations) == list(range(1, len(citations) + 1))
    shown = response_to_dict(r.json())["citations"]
    assert [c["score"] for c in shown] == [round(c["score"], 4) for c in citations]


def test_chat_citations_and_annotations_carry_relevance(service):
    r = service.client("bob").chat.completions.create(
        model="default", messages=[{"role": "user", "content": RESERVATION_Q}])
    citations = r.model_extra["citations"]
    annotations = [a.model_dump()["url_citation"] for a in r.choices[0].message.annotations]
    assert citations and len(annotations) == len(citations)
    for c, a in zip(citations, annotations, strict=True):
        assert c["relevance"] == pytest.approx(1 / (1 + math.exp(-c["score"])))
        assert a["relevance"] == c["relevance"]


# ------------------------------------------------------------------ unit: status mapping, the load hint


def _answering(status: int, body: dict | None = None, headers: dict | None = None) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body, headers=headers))


@pytest.mark.parametrize("status, headers, code, words", [
    (429, {"Retry-After": "7"}, 1, "the server is busy (429): too many requests waiting; retry in 7 s"),
    (503, None, 1, "the server failed (503): too many requests waiting"),
    (403, None, 2, "the key may not do this (403)"),
])
def test_status_codes_map_to_messages_and_exit_codes(status, headers, code, words):
    body = {"error": {"message": "too many\nrequests waiting", "type": "x", "param": None, "code": None}}
    with pytest.raises(ServerQueryError) as info:
        query_server("http://server", "rag_k", "hi", transport=_answering(status, body, headers))
    assert info.value.exit_code == code and words in str(info.value)


def test_an_answer_that_is_not_the_api_s():
    with pytest.raises(ServerQueryError, match="is it `rag serve`"):
        query_server("http://server", "rag_k", "hi", transport=_answering(200, {"hello": "world"}))


def test_the_hint_is_for_queries_that_mostly_loaded_models():
    assert loading_dominates({"load_embedder": 6.7, "load_reranker": 1.2, "embed": 0.05, "total": 8.1})
    assert loading_dominates({"load_embedder": 3.0, "load_generator": 3.0, "generate": 5.0, "total": 11.5})
    assert not loading_dominates({"load_embedder": 0.0, "load_reranker": 0.0, "embed": 0.05, "total": 0.2})
    assert not loading_dominates({"load_embedder": 1.0, "generate": 30.0, "total": 31.5})
    assert not loading_dominates({"embed": 0.1})  # no total: nothing to compare with
    hint = load_hint({"load_embedder": 6.7, "load_generator": 5.0, "total": 14.0})
    assert hint is not None and "11.7 s" in hint and "14.0 s" in hint
    assert "rag serve" in hint and "--server" in hint
    assert load_hint({"load_embedder": 0.1, "total": 9.0}) is None
