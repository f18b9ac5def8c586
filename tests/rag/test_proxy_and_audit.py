"""Proxy keys and the audit log over real HTTP (uvicorn on loopback, httpx and openai as clients).

A front end's proxy key names its user in a header and gets that user's directory groups; a
user key's headers change nothing. Every question, answered or refused, leaves one audit entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import httpx
import openai
import pytest

from rag.api.app import create_app
from rag.audit import AUDIT_FILE, AuditLog
from tests.rag.live_server import serving

GENOMICS_Q = "What temperature is the -80 freezer alarm set to?"


@pytest.fixture(scope="module")
def live(lab_rag):
    settings = lab_rag.settings.model_copy(update={
        "device": "cpu", "max_new_tokens": 4, "engine_num_kv_blocks": 256, "engine_max_num_seqs": 2,
        "request_timeout": 120.0})
    ids = lab_rag.identity
    keys = {"bob": ids.create_key("bob", ["imaging"]), "proxy": ids.create_key(None, label="open-webui", proxy=True)}
    with serving(create_app(settings, preload=False)) as url:
        yield url, keys, lab_rag.settings.home / AUDIT_FILE


def _query(url, key, headers=None, **body):
    body.setdefault("generate", False)
    return httpx.post(f"{url}/v1/query", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def _key_id(key: str) -> str:
    return key.split("_")[1]


def _entries(path, key):
    lines = path.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["key_id"] == _key_id(key)]


def _genomics(citations) -> bool:
    return any("/genomics/" in c["source"] for c in citations)


def test_a_user_keys_user_header_is_ignored(live):
    url, keys, _ = live
    r = _query(url, keys["bob"], {"X-Forwarded-User": "alice", "X-OpenWebUI-User-Email": "alice"},
               question=GENOMICS_Q, k=5)
    assert r.status_code == 200 and r.json()["user"] == "bob"
    assert not _genomics(r.json()["citations"])


def test_a_proxy_key_gets_the_named_users_directory_groups(live):
    url, keys, _ = live
    headers = {"X-OpenWebUI-User-Email": "alice", "X-OpenWebUI-User-Role": "admin",
               "X-Groups": "imaging,hpc-admins", "X-Forwarded-Groups": "hpc-admins"}
    r = _query(url, keys["proxy"], headers, question=GENOMICS_Q, k=5)
    assert r.status_code == 200 and r.json()["user"] == "alice"
    citations = r.json()["citations"]
    assert _genomics(citations)
    # The groups headers are ignored: nothing of imaging or hpc-admins, which alice may not read.
    assert not any("/imaging/" in c["source"] or "/hpc-admins/" in c["source"] for c in citations)
    gpu = _query(url, keys["proxy"], headers, question="Which GPU nodes can I use? Is there a reservation?", k=5)
    assert gpu.status_code == 200 and gpu.json()["citations"]
    assert not any("/imaging/" in c["source"] for c in gpu.json()["citations"])  # bob's key sees imaging/
    # The chat API, through the openai client as a front end would call it.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["proxy"], max_retries=0, timeout=120,
                           default_headers={"X-Forwarded-User": "bob"})
    assert [m.id for m in client.models.list()] == ["default"]
    reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": GENOMICS_Q}])
    assert not any("/genomics/" in c["source"] for c in reply.model_extra["citations"])  # bob's view


def test_a_proxy_key_without_a_user_header_is_403(live):
    url, keys, _ = live
    r = _query(url, keys["proxy"], question=GENOMICS_Q)
    assert r.status_code == 403 and "front-end key" in r.json()["error"]["message"]
    assert "X-OpenWebUI-User-Email" in r.json()["error"]["message"] and "citations" not in r.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["proxy"], max_retries=0, timeout=120)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": GENOMICS_Q}])


def test_an_unknown_user_is_403_without_saying_who_exists(live):
    url, keys, _ = live
    answers = [_query(url, keys["proxy"], {"X-Forwarded-User": name}, question=GENOMICS_Q)
               for name in ("mallory", "root", "alice@evil.example.com")]
    assert all(r.status_code == 403 for r in answers)
    assert len({r.json()["error"]["message"] for r in answers}) == 1
    assert not any(u in answers[0].text for u in ("alice", "bob", "carol", "mallory"))


@pytest.mark.parametrize("value", ["a" * 300, "ali\tce", "Alice Smith", "alic\xe9", "alice;group=hpc-admins"])
def test_a_malformed_or_oversized_user_header_is_400_and_the_server_goes_on(live, value):
    url, keys, _ = live
    r = _query(url, keys["proxy"], {"X-Forwarded-User": value.encode("latin-1")}, question=GENOMICS_Q)
    assert r.status_code == 400 and "X-Forwarded-User" in r.json()["error"]["message"]
    ok = _query(url, keys["proxy"], {"X-Forwarded-User": "alice"}, question=GENOMICS_Q)
    assert ok.status_code == 200 and ok.json()["user"] == "alice"


def _same_documents(audited: list[str], citations: list[dict]) -> bool:
    """The audit log (for operators) names documents by key; users see them under the ingest root."""
    shown = list(dict.fromkeys(c["document"] for c in citations))
    if len(audited) != len(shown):
        return False
    return all(key.endswith("/" + name) for key, name in zip(audited, shown, strict=True))


@pytest.mark.slow
def test_every_question_is_audited_without_its_text(live, lab_rag):
    url, _, path = live
    bob = lab_rag.identity.create_key("bob", ["imaging"])
    proxy = lab_rag.identity.create_key(None, label="librechat", proxy=True)
    answered = _query(url, bob, question=GENOMICS_Q + " (audit)", k=3)
    streamed = _query(url, bob, question="Which GPU nodes can I use?", stream=True)
    refused = [_query(url, proxy, question="who? (audit)"),
               _query(url, proxy, {"X-Forwarded-User": "nobody"}, question="unknown (audit)"),
               _query(url, proxy, {"X-Forwarded-User": "x y"}, question="bad (audit)"),
               _query(url, bob, question="elsewhere (audit)", collection="no-such-collection")]
    as_alice = _query(url, proxy, {"X-Forwarded-User": "alice"}, question=GENOMICS_Q, k=3)
    assert answered.status_code == streamed.status_code == as_alice.status_code == 200
    assert [r.status_code for r in refused] == [403, 403, 400, 404]
    bobs = _entries(path, bob)
    assert [e["status"] for e in bobs] == [200, 200, 404] and all(e["user"] == "bob" for e in bobs)
    assert _same_documents(bobs[0]["cited"], answered.json()["citations"])
    assert bobs[0]["cited"] and bobs[1]["stream"] and bobs[1]["cited"]
    assert bobs[2]["collection"] == "no-such-collection" and bobs[2]["cited"] == []
    proxied = _entries(path, proxy)
    assert [e["status"] for e in proxied] == [403, 403, 400, 200] and all(e["via_proxy"] for e in proxied)
    assert [e["user"] for e in proxied] == [None, None, None, "alice"]
    assert _same_documents(proxied[3]["cited"], as_alice.json()["citations"])
    assert bobs[0]["question_sha256"] == hashlib.sha256((GENOMICS_Q + " (audit)").encode()).hexdigest()
    for e in bobs + proxied:
        assert "question" not in e and e["latency_ms"] >= 0 and e["time"].endswith("+00:00")
    text = path.read_text()
    assert "(audit)" not in text and "temperature" not in text and "-65" not in text  # cited ids, no text
    assert os.stat(path).st_mode & 0o777 == 0o600
    # The CLI is the operator's reader: --user filters, --json prints one object a line.
    out = subprocess.run([sys.executable, "-m", "rag.cli", "--home", str(lab_rag.settings.home), "audit",
                          "--user", "bob", "--json"], capture_output=True, text=True, timeout=120, check=True)
    listed = [json.loads(line) for line in out.stdout.splitlines()]
    assert listed and all(e["user"] == "bob" for e in listed)
    assert [e for e in listed if e["key_id"] == _key_id(bob)] == bobs
    last = subprocess.run([sys.executable, "-m", "rag.cli", "--home", str(lab_rag.settings.home), "audit",
                           "--since", "2000-01-01", "--limit", "1"], capture_output=True, text=True, timeout=120)
    assert last.returncode == 0 and len(last.stdout.splitlines()) == 1  # no route reads it: the test below


def _every_route(app) -> list[tuple[str, set[str]]]:
    """(path, methods) of each route of `app`, those of its included routers too."""
    try:  # FastAPI 0.16x keeps an included router as one entry of app.routes
        from fastapi.routing import iter_route_contexts
    except ImportError:  # earlier versions copy its routes into app.routes
        return [(r.path, set(r.methods or ())) for r in app.routes]
    return [(c.path, set(c.methods or ())) for c in iter_route_contexts(app.routes)]


@pytest.mark.slow
def test_no_route_serves_the_audit_log(live, lab_rag):
    url, _, path = live
    marker = f"auditmarker{os.urandom(6).hex()}"
    admin = lab_rag.identity.create_key("bob", ["imaging"], admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    # The marker goes into the log the way a client's text does: a collection name, which is logged.
    assert _query(url, admin, question="Which GPU nodes can I use?", collection=marker).status_code == 404
    assert marker in path.read_text()
    routes = _every_route(create_app(lab_rag.settings, preload=False))  # the factory the server runs
    assert {"/v1/query", "/v1/chat/completions", "/v1/documents/{collection}/{chunk_id}", "/static/{name}",
            "/docs/{name}", "/metrics", "/metrics/engine"} <= {p for p, _ in routes}
    fills = ["default", "1", "bob", "audit", AUDIT_FILE, f"..%2F{AUDIT_FILE}", f"..%2F..%2F..%2F{AUDIT_FILE}",
             str(path)]
    bodies = [{"question": "What is in the audit log?", "generate": False},
              {"question": "What is in the audit log?", "stream": True, "k": 2},
              {"model": "default", "messages": [{"role": "user", "content": "Show me the audit log."}]}]
    requested = 0
    for route, methods in routes:
        params = re.findall(r"{(\w+)(?::\w+)?}", route)
        targets = [re.sub(r"{[^}]+}", fill, route) for fill in fills] if params else [route]
        for target in targets:
            for method in methods | {"GET", "POST"}:
                for body in bodies if method == "POST" else [None]:
                    r = httpx.request(method, f"{url}{target}", json=body, headers=headers, timeout=300)
                    requested += 1
                    shown = r.text + json.dumps(dict(r.headers))
                    assert marker not in shown and "question_sha256" not in shown, (method, target, r.status_code)
    assert requested > 100


@pytest.mark.slow
def test_audit_questions_keeps_the_question_text(lab_rag, tmp_path):
    settings = lab_rag.settings.model_copy(update={"device": "cpu", "audit_questions": True})
    with serving(create_app(settings, preload=False)) as url:
        key = lab_rag.identity.create_key("bob", ["imaging"])
        assert _query(url, key, question="Which GPU nodes can I use? (kept)").status_code == 200
        (entry,) = _entries(lab_rag.settings.home / AUDIT_FILE, key)
        assert entry["question"] == "Which GPU nodes can I use? (kept)" and entry["status"] == 200


@pytest.mark.parametrize("breaker", ["\u2028", "\u2029", "\x85", "\n", "\r", "\x1c"])
def test_an_entry_stays_one_line_whatever_a_client_sends(tmp_path, breaker):
    # A client chooses the collection name and the question; characters that some line readers
    # take as line breaks must not split an entry or forge a second one (the CI once read a
    # fuzzed collection name cut in half with splitlines).
    log = AuditLog(tmp_path / AUDIT_FILE)
    forged = f'x{breaker}{{"user":"alice","status":200}}'
    log.write({"user": "bob", "collection": forged, "status": 404})
    log.write({"user": "bob", "collection": "ok", "status": 200})
    log.close()
    text = (tmp_path / AUDIT_FILE).read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) == 2
    assert [json.loads(line)["collection"] for line in lines] == [forged, "ok"]
    assert [e["user"] for e in log.read()] == ["bob", "bob"]
    # The operator's view prints them the same way (the CI once cut `rag audit --json` output too).
    shown = subprocess.run([sys.executable, "-m", "rag.cli", "--home", str(tmp_path), "audit", "--json"],
                           capture_output=True, text=True, timeout=120, check=True, env={**os.environ,
                           "PYTHONIOENCODING": "utf-8"}).stdout.splitlines()
    assert [json.loads(line)["collection"] for line in shown] == [forged, "ok"]
