"""Bad requests to `rag serve` over real HTTP: the key before the body, capped bodies, strict types,
one error shape, nothing of the request quoted back or logged, and stage timings for admin keys only.

Some requests are written on a raw socket (tests/rag/raw_http.py), so that a test can declare a
body it never sends: a server that waited for that body before answering would never answer.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from rag.api.app import create_app
from tests.rag.live_server import serving
from tests.rag.raw_http import raw_request

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

CAP = 64 * 1024
MARKER = "zqxj-secret-marker"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def live(lab_rag):
    keys = {"bob": lab_rag.identity.create_key("bob", ["imaging"]),
            "admin": lab_rag.identity.create_key("carol", admin=True)}
    # Generation: the timings and usage checks below are about generated answers.
    settings = lab_rag.settings.model_copy(update={"max_request_bytes": CAP, "device": "cpu",
                                                   "answer_mode": "generate"})
    with serving(create_app(settings, preload=False)) as url:
        yield url, keys


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _post(url: str, path: str, key: str | None, body: object = None, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=300,
                      headers={**_auth(key), "Content-Type": "application/json"})


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, r.text
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]


# --- the key before the body ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions"])
def test_invalid_json_without_a_key_is_401(live, path):
    url, _ = live
    r = _post(url, path, None, raw=b'{"question": ')
    assert r.status_code == 401 and _error(r)["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions"])
def test_a_huge_declared_body_without_a_key_is_401_unread(live, path):
    url, _ = live
    # 50 MB declared, none sent: the answer can only come if the server does not wait for it.
    status, body = raw_request(url, [f"POST {path} HTTP/1.1", "Content-Type: application/json",
                              "Content-Length: 50000000"])
    assert status == 401 and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions"])
def test_a_huge_declared_body_with_a_key_is_413_unread(live, path):
    url, keys = live
    status, body = raw_request(url, [f"POST {path} HTTP/1.1", f"Authorization: Bearer {keys['bob']}",
                              "Content-Type: application/json", "Content-Length: 50000000"])
    assert status == 413 and set(body["error"]) == ERROR_KEYS and str(CAP) in body["error"]["message"]


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap(live):
    url, keys = live
    piece = b"x" * 8192
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(CAP // len(piece) + 1))
    # No terminating chunk: a server reading the whole body first would wait for ever.
    status, body = raw_request(url, ["POST /v1/query HTTP/1.1", f"Authorization: Bearer {keys['bob']}",
                              "Content-Type: application/json", "Transfer-Encoding: chunked"], chunks)
    assert status == 413 and set(body["error"]) == ERROR_KEYS


def test_a_body_within_the_cap_still_answers(live):
    url, keys = live
    r = _post(url, "/v1/query", keys["bob"], {"question": "Which GPU nodes can I use?", "generate": False})
    assert r.status_code == 200 and r.json()["citations"]


# --- strict types, capped fields, one shape ------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("generate", "yes"), ("generate", 1), ("k", True), ("k", 5.0), ("k", "5"), ("stream", "false"),
    ("question", 5), ("collection", ["default"]), ("mode", "semantic"), ("k", 0), ("k", 10**10),
])
def test_query_fields_are_strict(live, field, value):
    url, keys = live
    body = {"question": "Which GPU nodes can I use?", "generate": False, field: value}
    r = _post(url, "/v1/query", keys["bob"], body)
    assert r.status_code == 400, r.text
    error = _error(r)
    assert error["type"] == "invalid_request_error" and error["param"] == field


def test_an_unknown_query_field_is_400_without_its_name(live):
    url, keys = live
    r = _post(url, "/v1/query", keys["bob"], {"question": "Which GPU nodes?", "colection": "x", MARKER: 1})
    assert r.status_code == 400 and "does not take" in _error(r)["message"]
    assert MARKER not in r.text and "colection" not in r.text


@pytest.mark.parametrize("field, value", [
    ("stream", "yes"), ("max_tokens", True), ("max_tokens", "8"), ("temperature", "0.5"), ("temperature", True),
    ("n", 1.0), ("seed", 2**70), ("user", "u" * 300), ("messages", [{"role": MARKER, "content": "hi"}]),
])
def test_chat_fields_are_strict(live, field, value):
    url, keys = live
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], field: value}
    r = _post(url, "/v1/chat/completions", keys["bob"], body)
    assert r.status_code == 400, r.text
    assert _error(r)["param"].split(".")[0] == field and MARKER not in r.text


@pytest.mark.parametrize("raw", [b'{"question": NaN}', b'{"question": "x", "k": Infinity}',
                                 b'{"question": "x", "k": ' + b"9" * 5000 + b"}", b"[" * 60000,
                                 b'{"question": "\\ud800"}', b"\xff\xfe", b"[1]", b""])
def test_malformed_bodies_are_400s(live, raw):
    url, keys = live
    for path in ("/v1/query", "/v1/chat/completions"):
        r = _post(url, path, keys["bob"], raw=raw)
        assert r.status_code == 400, (path, raw[:40], r.text)
        assert _error(r)["type"] == "invalid_request_error"


def test_nothing_of_the_request_is_quoted_back(live):
    url, keys = live
    long_question = MARKER + "x" * 6000  # past the 4000-character cap, within the body cap
    responses = [
        _post(url, "/v1/query", keys["bob"], {"question": long_question}),
        _post(url, "/v1/query", keys["bob"], {"question": MARKER * 10000}),  # past the body cap
        _post(url, "/v1/query", keys["bob"], {"question": "Which GPU nodes?", "collection": MARKER}),
        _post(url, "/v1/query", keys["bob"], {"question": "Which GPU nodes?", "mode": MARKER}),
        _post(url, "/v1/chat/completions", keys["bob"],
              {"model": MARKER, "messages": [{"role": "user", "content": "hi"}]}),
        _post(url, "/v1/chat/completions", keys["bob"],
              {"model": "default", "messages": [{"role": "user", "content": [{"type": MARKER}]}]}),
        httpx.get(f"{url}/v1/{MARKER}", headers=_auth(keys["bob"]), timeout=30),
        httpx.get(f"{url}/v1/documents/default/{MARKER}", headers=_auth(keys["bob"]), timeout=30),
    ]
    assert [r.status_code for r in responses] == [400, 413, 404, 400, 404, 400, 404, 404]
    for r in responses:
        _error(r)
        assert MARKER not in r.text and len(r.content) < 2000, r.text


@pytest.mark.parametrize("chunk_id", ["\u00b2", "\u0661", "1" * 21, "-1", "1.0"])
def test_a_chunk_id_that_is_not_ascii_digits_is_404(live, chunk_id):
    # Found by the schema fuzz (slow profile): "²".isdigit() is true, int("²") raises: a 500.
    url, keys = live
    r = httpx.get(f"{url}/v1/documents/default/{chunk_id}", headers=_auth(keys["bob"]), timeout=30)
    assert r.status_code == 404 and _error(r)["message"] == "no such document"


def test_every_error_has_the_one_shape(live):
    url, keys = live
    cases = [
        (httpx.post(f"{url}/v1/query", json={"question": "x"}, timeout=30), 401),
        (httpx.get(f"{url}/v1/models", timeout=30), 401),
        (httpx.get(f"{url}/v1/query", headers=_auth(keys["bob"]), timeout=30), 405),
        (httpx.get(f"{url}/nowhere", timeout=30), 404),
        (_post(url, "/v1/query", keys["bob"], {"question": "   "}), 400),  # a ConfigError from the pipeline
        (_post(url, "/v1/query", keys["bob"], {"question": "x", "collection": "no-such-one"}), 404),
        (httpx.get(f"{url}/metrics/engine", headers=_auth(keys["bob"]), timeout=30), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, (status, r.text)
        _error(r)


def test_no_request_text_reaches_the_logs(live, caplog):
    url, keys = live
    caplog.set_level(logging.DEBUG)
    _post(url, "/v1/query", keys["bob"], {"question": MARKER + "x" * 6000})
    _post(url, "/v1/query", keys["bob"], {"question": f"Which GPU nodes? {MARKER}", "generate": False})
    _post(url, "/v1/query", keys["bob"], raw=f'{{"question": "{MARKER}", '.encode())
    _post(url, "/v1/query", None, {"question": MARKER})
    _post(url, "/v1/chat/completions", keys["bob"],
          {"model": MARKER, "messages": [{"role": "user", "content": MARKER}]})
    assert caplog.records  # the access lines are there...
    assert not any(MARKER in r.getMessage() or MARKER in str(r.__dict__) for r in caplog.records)  # ...no text


# --- timings: admin keys only ---------------------------------------------------------------------------------

def test_query_timings_only_for_admin_keys(live):
    url, keys = live
    body = {"question": "Which GPU nodes can I use?", "generate": False, "mode": "hybrid"}
    user = _post(url, "/v1/query", keys["bob"], body)
    admin = _post(url, "/v1/query", keys["admin"], body)
    assert user.status_code == admin.status_code == 200
    assert user.json()["timings_ms"] is None and user.json()["citations"]
    assert {"keyword", "search", "total"} <= set(admin.json()["timings_ms"])
    assert not any(k.lower().startswith(("server-timing", "x-timing", "x-response-time")) for k in user.headers)


def test_streamed_done_event_has_no_timings_for_a_user_key(live):
    url, keys = live
    events = []
    with httpx.stream("POST", f"{url}/v1/query", headers=_auth(keys["bob"]), timeout=300,
                      json={"question": "Which GPU nodes can I use?", "k": 2, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] > 0
    assert "timings_ms" not in done


def test_chat_completion_timings_only_for_admin_keys(live):
    url, keys = live
    body = {"model": "default", "messages": [{"role": "user", "content": "Which GPU nodes can I use?"}],
            "max_tokens": 4}
    user = _post(url, "/v1/chat/completions", keys["bob"], body)
    admin = _post(url, "/v1/chat/completions", keys["admin"], body)
    assert user.status_code == admin.status_code == 200, (user.text, admin.text)
    assert "timings_ms" not in user.json() and user.json()["usage"]["completion_tokens"] > 0
    assert {"generate", "total"} <= set(admin.json()["timings_ms"])


def test_engine_metrics_for_admin_keys(live):
    url, keys = live
    assert httpx.get(f"{url}/metrics/engine", headers=_auth(keys["bob"]), timeout=30).status_code == 404
    admin = httpx.get(f"{url}/metrics/engine", headers=_auth(keys["admin"]), timeout=30)
    assert admin.status_code == 200 and "admission" in admin.json()
