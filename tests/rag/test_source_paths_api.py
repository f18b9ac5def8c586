"""No API response names a server path: citations, annotations and document fetches show sources under their root."""

from __future__ import annotations

import httpx
import pytest

from rag.api.app import create_app
from tests.rag.live_server import serving

QUESTION = "How do I book the confocal microscope?"


@pytest.fixture(scope="module")
def server(lab_rag):
    key = lab_rag.identity.create_key("bob")
    with serving(create_app(lab_rag.settings)) as url:
        yield url, {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_citations_and_documents_show_paths_under_the_ingest_root(server, lab_copy, lab_rag):
    url, headers = server
    query = httpx.post(f"{url}/v1/query", headers=headers, timeout=300, json={"question": QUESTION, "generate": False})
    assert query.status_code == 200, query.text
    assert query.json()["citations"] and all(c["source"].startswith("lab-docs/") and c["document"] == c["source"]
                                             for c in query.json()["citations"])
    chat = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=300,
                      json={"model": "default", "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}]})
    assert chat.status_code == 200, chat.text
    cited = chat.json()["citations"]
    assert cited and all(c["source"].startswith("lab-docs/") for c in cited)
    fetched = [httpx.get(c["url"], headers=headers) for c in cited]  # as a front end follows url_citation
    assert all(d.status_code == 200 and d.json()["source"].startswith("lab-docs/") for d in fetched)
    for body in [query.text, chat.text, *(d.text for d in fetched)]:
        for server_path in (str(lab_copy.parent), str(lab_rag.settings.home.resolve()), "/tmp/"):
            assert server_path not in body
