"""The built-in chat page at `/`: its static route, and the page itself in a real headless Chromium.

The route tests need no browser: in-process (httpx over ASGI, hand-made ASGI requests for paths a
client would normalise) and over a real uvicorn on loopback. The browser tests start a real
`rag serve` with the sample corpus and drive Debian's Chromium through Playwright: bob (group
imaging) and dave (no groups) ask the same question, each in a fresh browser context, and read
what the page shows.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from rag.api.app import create_app
from rag.api.routes.page import STATIC_DIR
from rag.settings import load_settings
from tests.rag.headless_chromium import chromium
from tests.rag.live_server import serving
from tests.rag.serve_fixture import Service, prepare_home, running_service

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the route tests still run; the browser tests skip
    expect = sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
RESERVATION_Q = "Which Slurm reservation does the imaging group have on the GPU nodes?"
ANSWER_TIMEOUT_MS = 300_000

# Paths that name something outside the static folder, or nothing: all a 404, never a file or a 500.
OUTSIDE = ["/static/..%2Fapp.py", "/static/..%2F..%2F..%2Fpyproject.toml", "/static/%2e%2e%2fapp.py",
           "/static/%2Fetc%2Fpasswd", "/static/..%5Capp.py", "/static/%00", "/static/index.html%00.js",
           "/static/", "/static/nope.js", "/static/.", "/static/%2e%2e", "/static/routes",
           "/static/static%2Findex.html", "/static//etc/passwd", "/static/C:%5Cwindows"]
RAW_OUTSIDE = ["/static/../app.py", "/static/../../../pyproject.toml", "/static/./index.html/..",
               "/static/../routes/page.py", "/static/..", "/static/...."]


# ---------------------------------------------------------------- the route, in-process


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return create_app(load_settings(home=tmp_path_factory.mktemp("page-home")), preload=False)


def _get(app, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get(path)
    return asyncio.run(go())


def _raw_get(app, path: str) -> tuple[int, dict[str, str], bytes]:
    """One GET with this path as the server would see it (no client-side `..` normalisation)."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_index_and_static_files_with_types_and_csp(app):
    for path, kind, name in [("/", "text/html", "index.html"), ("/static/index.html", "text/html", "index.html"),
                             ("/static/app.js", "text/javascript", "app.js"),
                             ("/static/style.css", "text/css", "style.css")]:
        r = _get(app, path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith(kind), (path, r.headers["content-type"])
        assert r.content == (STATIC_DIR / name).read_bytes()
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"


def test_static_route_refuses_anything_outside_its_folder(app):
    for path in OUTSIDE:
        r = _get(app, path)
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
        assert "import" not in r.text and "root:" not in r.text
    for path in RAW_OUTSIDE:
        status, _, body = _raw_get(app, path)
        assert status == 404, (path, status, body[:200])
        assert b"import" not in body and b"[project]" not in body


def test_the_page_puts_no_server_text_through_html():
    js = (STATIC_DIR / "app.js").read_text()
    assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
    assert "document.write" not in js and "eval(" not in js
    html = (STATIC_DIR / "index.html").read_text()
    assert "<script>" not in html and "style=" not in html and "http" not in html  # nothing inline, no CDN
    assert "localStorage" not in js and "sessionStorage" in js


def test_real_server_refuses_paths_outside_the_static_folder(tmp_path):
    # Over a real uvicorn on loopback (what `rag serve` runs), with paths sent exactly as written;
    # no browser is needed, so this runs without Chromium.
    with serving(create_app(load_settings(home=tmp_path / "home"), preload=False)) as url:
        parts = urlsplit(url)
        for path in OUTSIDE + RAW_OUTSIDE:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            try:
                conn.request("GET", path)  # sent as written: no `..` or %2F normalisation on the way
                r = conn.getresponse()
                body = r.read()
            finally:
                conn.close()
            assert r.status in (400, 404), (path, r.status, body[:200])
            assert b"import" not in body and b"[project]" not in body
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:  # the same server does serve the folder's own files
            conn.request("GET", "/static/app.js")
            r = conn.getresponse()
            assert r.status == 200 and r.read() == (STATIC_DIR / "app.js").read_bytes()
        finally:
            conn.close()


# ---------------------------------------------------------------- the page, in Chromium


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache) -> Iterator[Service]:
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium) for the browser tests")
    home = tmp_path_factory.mktemp("page-serve-home")
    keys = prepare_home(home, tmp_path_factory.mktemp("page-serve-corpus"), model_cache)
    env = {"RAG_MAX_NEW_TOKENS": "16", "RAG_TOP_K": "3", "RAG_ENGINE_NUM_KV_BLOCKS": "640"}
    with running_service(home, keys, env) as service:
        yield service


@pytest.fixture(scope="module")
def browser(service):
    with chromium() as browser:
        yield browser


class PageRun:
    """One fresh browser context on the chat page, with its console errors collected."""

    def __init__(self, browser, service: Service) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 800})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.goto(f"{service.url}/")

    def enter_key(self, key: str) -> None:
        self.page.fill("#key", key)
        self.page.click("#key-use")

    def collections(self) -> list[str]:
        self.page.wait_for_selector("#collection:not([disabled])")
        return self.page.eval_on_selector_all("#collection option", "els => els.map(e => e.value)")

    def ask(self, question: str, collection: str = "default") -> str:
        self.page.select_option("#collection", collection)
        self.page.fill("#question", question)
        self.page.click("#ask")
        self.page.wait_for_selector("#answer[data-state=done], #answer[data-state=error]", timeout=ANSWER_TIMEOUT_MS)
        return self.page.get_attribute("#answer", "data-state")

    def citations(self) -> list[str]:
        return self.page.locator("#citations li").all_inner_texts()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def run(browser, service):
    runs: list[PageRun] = []

    def start() -> PageRun:
        runs.append(PageRun(browser, service))
        return runs[-1]

    yield start
    for r in runs:
        r.close()


@pytest.mark.slow
def test_bob_streams_an_answer_with_his_citations_and_opens_one(run, service):
    bob = run()
    bob.enter_key(service.keys["bob"])
    assert sorted(bob.collections()) == ["default", "imaging-notes"]
    assert service.keys["bob"] not in bob.page.url
    assert bob.page.evaluate("sessionStorage.getItem('labrag.key')") == service.keys["bob"]
    assert bob.page.input_value("#key") == ""  # not left in the field either

    assert bob.ask(RESERVATION_Q) == "done", bob.page.inner_text("#error")
    assert bob.page.inner_text("#answer").strip()
    assert bob.page.is_hidden("#error")
    citations = bob.citations()
    assert any("gpu-reservation" in c for c in citations), citations
    # Each reranked citation shows the server's calibrated relevance, not the raw logit.
    assert all(re.search(r"relevance [01]\.\d\d", c) for c in citations), citations

    # Clicking the citation fetches its text with the key and shows it in the panel.
    item = bob.page.locator("#citations li", has_text="gpu-reservation").first
    url = item.locator("button").get_attribute("data-url")
    item.locator("button").click()
    expect(bob.page.locator("#doc-text")).not_to_be_empty()  # locators, not wait_for_function: the CSP bars eval
    expected = httpx.get(url, headers=service.auth("bob"), timeout=30).json()
    assert bob.page.text_content("#doc-text") == expected["text"]
    assert "gpu-reservation" in bob.page.inner_text("#doc-meta")
    assert bob.page.is_visible("#doc-panel")
    shot = os.environ.get("RAG_CHAT_PAGE_SCREENSHOT")
    if shot:
        bob.page.screenshot(path=shot, full_page=True)
    bob.page.click("#doc-close")
    assert bob.page.is_hidden("#doc-panel")
    assert not bob.problems, bob.problems


@pytest.mark.slow
def test_dave_sees_no_imaging_citation_and_no_reservation_name(run, service):
    dave = run()
    # A fresh context: nothing of bob's key.
    assert dave.page.evaluate("sessionStorage.getItem('labrag.key')") is None
    dave.enter_key(service.keys["dave"])
    assert dave.collections() == ["default"]
    assert dave.ask(RESERVATION_Q) == "done", dave.page.inner_text("#error")
    citations = dave.citations()
    assert not any("imaging" in c for c in citations), citations
    for link in dave.page.locator("#citations li button").all():
        link.click()
        expect(dave.page.locator("#doc-meta")).not_to_have_text("loading\u2026")
        assert "cryoem-res" not in dave.page.text_content("#doc-text")
    assert "cryoem-res" not in dave.page.content()
    assert "cryoem-res" not in dave.page.inner_text("body")
    assert not dave.problems, dave.problems


@pytest.mark.slow
def test_errors_are_shown_in_words(run, service):
    page = run()
    page.enter_key("rag_not-a-real-key")
    expect(page.page.locator("#key-state")).to_have_text("key not accepted")
    expect(page.page.locator("#error")).to_contain_text("401")
    assert "key was refused" in page.page.inner_text("#error")
    assert page.page.is_disabled("#ask")

    # A collection the key cannot read (offered by hand: the picker never lists it): the server's 404.
    page.enter_key(service.keys["dave"])
    assert page.collections() == ["default"]
    page.page.evaluate("document.getElementById('collection').append(new Option('imaging-notes', 'imaging-notes'))")
    assert page.ask(RESERVATION_Q, collection="imaging-notes") == "error"
    assert "404" in page.page.inner_text("#error")
    assert not page.citations()

    # A busy service: 429 with Retry-After (the server's own answer, replayed: a full queue is hard to time).
    body = json.dumps({"error": {"message": "too many requests waiting", "type": "rate_limit_error",
                                 "param": None, "code": None}})
    page.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=429, headers={"Retry-After": "7", "Content-Type": "application/json"}, body=body))
    assert page.ask(RESERVATION_Q) == "error"
    error = page.page.inner_text("#error")
    assert "429" in error and "busy" in error and "7 s" in error, error


@pytest.mark.slow
def test_server_text_is_shown_as_text_never_as_html(run, service):
    page = run()
    page.enter_key(service.keys["dave"])
    page.collections()
    evil = '<img src=x id=injected onerror="window.pwned=1">'
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Answer " + evil}, "finish_reason": None}]},
              {"choices": [{"index": 0, "finish_reason": None, "delta": {"annotations": [
                  {"type": "url_citation", "url_citation": {"url": f"{service.url}/v1/documents/default/1",
                                                            "title": "[1] " + evil, "text": evil,
                                                            "source": evil}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse))
    assert page.ask("anything") == "done"
    assert page.page.inner_text("#answer") == "Answer " + evil
    assert evil in page.citations()[0]
    assert page.page.locator("#injected").count() == 0
    assert page.page.evaluate("window.pwned") is None
