"""The HTTP API over real HTTP: uvicorn on a free loopback port, httpx as the client."""

from __future__ import annotations

import httpx
import pytest

from rag.api.app import create_app
from tests.rag.live_server import serving


@pytest.fixture(scope="module")
def server(lab_rag):
    keys = {
        "bob": lab_rag.identity.create_key("bob", ["imaging"]),
        "dave": lab_rag.identity.create_key("dave", []),
    }
    with serving(create_app(lab_rag.settings)) as url:
        yield url, keys


def _query(url, key, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body.setdefault("generate", False)
    return httpx.post(f"{url}/v1/query", json=body, headers=headers, timeout=300)


def test_healthz(server):
    url, _ = server
    r = httpx.get(f"{url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}  # nothing about the data without a key


@pytest.mark.parametrize("key", [None, "", "rag_nope_nope", "not-a-key"])
def test_missing_or_wrong_key_is_401_without_results(server, key):
    url, _ = server
    r = _query(url, key, question="Which GPU nodes can I use?")
    assert r.status_code == 401
    assert "citations" not in r.text and "gpu01" not in r.text
    assert r.headers.get("www-authenticate") == "Bearer"


def test_401_comes_before_body_validation(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/query", json={"question": ""}, timeout=30)
    assert r.status_code == 401


def test_keys_see_what_their_user_may_read(server):
    url, keys = server
    q = "Which GPU nodes can I use? Is there a reservation?"
    bob = _query(url, keys["bob"], question=q, k=5).json()
    dave = _query(url, keys["dave"], question=q, k=5).json()
    assert bob["user"] == "bob" and dave["user"] == "dave"
    assert any("cryoem-res" in c["text"] for c in bob["citations"])
    assert not any("cryoem-res" in c["text"] for c in dave["citations"])
    assert all("/public/" in c["source"] for c in dave["citations"])


def test_bad_requests_are_clear(server):
    url, keys = server
    r = _query(url, keys["dave"], question="x", collection="nope")
    assert r.status_code == 404 and "unknown collection" in r.json()["error"]["message"]
    r = _query(url, keys["dave"], question="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "question"
    r = _query(url, keys["dave"], question="   ")
    assert r.status_code == 400 and "empty question" in r.json()["error"]["message"]


def test_generated_answer_over_http(server):
    url, keys = server
    r = _query(url, keys["dave"], question="Which GPU nodes can I use?", k=2, generate=True)
    assert r.status_code == 200
    body = r.json()
    assert body["answer"] and body["citations"]
    assert body["timings_ms"] is None  # stage timings go to admin keys only (tests/rag/test_bad_requests.py)
