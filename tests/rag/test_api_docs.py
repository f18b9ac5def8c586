"""The API docs page (/docs) works offline, and /openapi.json documents the errors the service answers.

The page test loads /docs from a real server in Debian's headless Chromium (Playwright, as
tests/rag/test_chat_page.py does) with every request to a host other than the loopback aborted,
and reads the operations Swagger UI rendered. The same blocking is first shown to blank
FastAPI's own CDN-loaded page, so the test would fail on the page this one replaced.

The schema tests read /openapi.json, and compare it with what the real server answers over HTTP
for a missing key, a bad body, a body over the cap, an unknown collection and a full queue (the
app loads no model: each is refused before retrieval).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI

from rag.api.app import create_app
from rag.api.error_docs import ErrorBody
from rag.api.openapi_docs import CSP
from rag.pipeline import Rag
from tests.rag.headless_chromium import chromium
from tests.rag.live_server import serving

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the schema tests still run; the browser test skips
    expect = sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
ERROR_REF = "#/components/schemas/ErrorBody"
MAX_BODY = 2000
QUESTION_ROUTES = [("post", "/v1/query"), ("post", "/v1/chat/completions")]


@pytest.fixture(scope="module")
def served(lab_rag) -> Iterator[tuple[str, str, Rag]]:
    """A real server on the sample corpus: one generation at a time, no queue, a small body cap."""
    key = lab_rag.identity.create_key("bob", ["imaging"])
    settings = lab_rag.settings.model_copy(update={
        "device": "cpu", "max_concurrent_generations": 1, "max_queued_generations": 0, "max_request_bytes": MAX_BODY})
    app = create_app(settings, preload=False)
    with serving(app) as url:
        yield url, key, app.state.rag


@pytest.fixture(scope="module")
def spec(served) -> dict:
    url, _, _ = served
    return httpx.get(f"{url}/openapi.json", timeout=30).json()


def _operations(spec: dict) -> Iterator[tuple[str, str, dict]]:
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            yield method, path, operation


def _documented(spec: dict, method: str, path: str, status: int) -> dict:
    responses = spec["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} does not document {status}: {sorted(responses)}"
    return responses[str(status)]


def _assert_answer_is_documented(spec: dict, method: str, path: str, response: httpx.Response) -> None:
    """The answer's status is documented for the route, with the error body and the headers it carries."""
    entry = _documented(spec, method, path, response.status_code)
    assert entry["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
    ErrorBody.model_validate(response.json())  # the documented model, extra keys forbidden
    for header in entry.get("headers", {}):
        assert header in response.headers, (path, response.status_code, header, dict(response.headers))


# ---------------------------------------------------------------- the schema


def test_every_keyed_route_documents_401_with_the_error_body(spec):
    keyed = [(m, p, op) for m, p, op in _operations(spec) if op.get("security")]
    assert {f"{m.upper()} {p}" for m, p, _ in keyed} >= {
        "POST /v1/query", "POST /v1/chat/completions", "GET /v1/models",
        "GET /v1/documents/{collection}/{chunk_id}", "GET /metrics/engine"}
    for method, path, _ in keyed:
        for status in (400, 401, 403):
            entry = _documented(spec, method, path, status)
            assert entry["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, (path, status)
        assert "WWW-Authenticate" in _documented(spec, method, path, 401)["headers"]


def test_question_routes_document_400_413_429_with_retry_after_and_the_generator_errors(spec):
    for method, path in QUESTION_ROUTES:
        for status in (400, 404, 413, 429, 502, 503, 504):
            entry = _documented(spec, method, path, status)
            assert entry["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, (path, status)
            assert entry["description"], (path, status)
        assert _documented(spec, method, path, 429)["headers"]["Retry-After"]["schema"] == {"type": "integer"}
        assert "Retry-After" in _documented(spec, method, path, 503)["headers"]


def test_the_error_body_is_openai_shaped_and_no_422_is_documented(spec):
    models = spec["components"]["schemas"]
    detail = models["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}
    assert set(detail["required"]) == {"message", "type"} and detail["additionalProperties"] is False
    assert models["ErrorBody"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    # Invalid input is a 400 here: FastAPI's automatic 422 (and its model) would promise what never comes.
    assert "HTTPValidationError" not in models
    for method, path, operation in _operations(spec):
        assert "422" not in operation["responses"], f"{method.upper()} {path}"
    ready = spec["paths"]["/readyz"]["get"]["responses"]
    assert ready["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Ready"}


def test_what_the_server_answers_is_what_the_schema_documents(served, spec):
    url, key, rag = served
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=30) as client:
        for method, path, operation in _operations(spec):
            if operation.get("security"):  # no key: 401
                concrete = path.replace("{collection}", "default").replace("{chunk_id}", "1")
                _assert_answer_is_documented(spec, method, path, client.request(method.upper(), concrete))
        for method, path in QUESTION_ROUTES:
            r = client.post(path, headers=auth, content=b"{not json")
            assert r.status_code == 400, r.text
            _assert_answer_is_documented(spec, method, path, r)
            r = client.post(path, headers=auth, content=b"{" + b" " * MAX_BODY + b"}")
            assert r.status_code == 413, r.text
            _assert_answer_is_documented(spec, method, path, r)
        r = client.post("/v1/query", headers=auth, json={"question": "q", "collection": "nope"})
        assert r.status_code == 404, r.text
        _assert_answer_is_documented(spec, "post", "/v1/query", r)
        r = client.get("/v1/documents/default/999999999", headers=auth)
        assert r.status_code == 404, r.text
        _assert_answer_is_documented(spec, "get", "/v1/documents/{collection}/{chunk_id}", r)

        # A full queue: the one generation slot held, no place to wait. Refused before retrieval.
        with _holding_the_only_slot(rag):
            for method, path, body in [("post", "/v1/query", {"question": "q"}),
                                       ("post", "/v1/chat/completions",
                                        {"model": "default", "messages": [{"role": "user", "content": "q"}]})]:
                r = client.post(path, headers=auth, json=body)
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                _assert_answer_is_documented(spec, method, path, r)


class _holding_the_only_slot:
    """Holds one admission slot, on a loop of its own, until the block ends."""

    def __init__(self, rag: Rag) -> None:
        self.rag, self.held, self.release = rag, threading.Event(), threading.Event()

    def __enter__(self) -> None:
        async def hold() -> None:
            async with self.rag.admission.slot():
                self.held.set()
                await asyncio.to_thread(self.release.wait)

        self.thread = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
        self.thread.start()
        assert self.held.wait(30)

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.join(30)


# ---------------------------------------------------------------- the page, in-process over HTTP


def test_docs_page_and_its_files_are_served_locally_under_a_strict_csp(served):
    url, _, _ = served
    page = httpx.get(f"{url}/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert "script-src 'self';" in CSP and "unsafe-eval" not in CSP
    assert "http" not in page.text.replace('href="/openapi.json"', "")  # no CDN, no other host
    assert "<script>" not in page.text  # nothing inline: the CSP would refuse it
    for name, kind in [("swagger-ui-bundle.js", "text/javascript"), ("swagger-ui.css", "text/css"),
                       ("swagger-init.js", "text/javascript")]:
        r = httpx.get(f"{url}/docs/{name}", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (name, r.status_code)
        assert len(r.content) > 100
    for path in ["/redoc", "/docs/..%2Fapp.py", "/docs/nope.js", "/docs/oauth2-redirect"]:
        r = httpx.get(f"{url}{path}", timeout=30)
        assert r.status_code == 404, (path, r.status_code)
        ErrorBody.model_validate(r.json())


# ---------------------------------------------------------------- the page, in Chromium, offline


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


class OfflinePage:
    """A fresh browser context where every request to a host other than 127.0.0.1 is aborted."""

    def __init__(self, browser) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 900})
        self.blocked: list[str] = []
        self.problems: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)

    def _route(self, route) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def close(self) -> None:
        self.context.close()


@pytest.mark.slow
def test_the_blocking_blanks_fastapis_cdn_page(browser):
    """FastAPI's own /docs (the page before this one) renders nothing offline: the check below has teeth."""
    cdn_app = FastAPI(title="cdn docs")

    @cdn_app.post("/v1/chat/completions", summary="Answer a chat from a collection")
    async def chat() -> dict:
        return {}

    offline = OfflinePage(browser)
    try:
        with serving(cdn_app) as url:
            offline.page.goto(f"{url}/docs")
            offline.page.wait_for_timeout(1000)  # what loads, loads from the loopback at once
            assert offline.blocked, "the CDN page asked no other host"
            assert offline.page.locator(".opblock").count() == 0
    finally:
        offline.close()


@pytest.mark.slow
def test_docs_renders_every_operation_offline_with_its_error_responses(browser, served, spec):
    url, _, _ = served
    offline = OfflinePage(browser)
    try:
        offline.page.goto(f"{url}/docs")
        chat = offline.page.locator(".opblock", has=offline.page.locator(
            ".opblock-summary-path", has_text="/v1/chat/completions"))
        expect(chat).to_have_count(1, timeout=30_000)
        summary = spec["paths"]["/v1/chat/completions"]["post"]["summary"]
        expect(chat.locator(".opblock-summary-description")).to_have_text(summary)
        shown = {(m.upper(), p) for m, p, _ in _operations(spec)}
        rendered = offline.page.locator(".opblock-summary-path").all_inner_texts()
        assert {p.replace("\u200b", "") for _, p in shown} == {p.replace("\u200b", "") for p in rendered}

        # Opened, the operation lists its error responses with the error body and Retry-After.
        chat.locator(".opblock-summary").click()
        responses = chat.locator(".responses-table")
        expect(responses).to_contain_text("429")
        expect(responses).to_contain_text("Retry-After")
        expect(responses).to_contain_text("401")
        assert not offline.blocked, offline.blocked
        assert not offline.problems, offline.problems
    finally:
        offline.close()
