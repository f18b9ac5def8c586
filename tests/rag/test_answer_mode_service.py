"""The service loads the generator only when its answers are generated (rag/api/app.py).

With extracted answers (`answer_mode` "extract", or "auto" with the packaged 135M model) no
request can generate, so the API must not hold the generator's weights (or, on a GPU, its KV
cache). The state checked is the Rag's own: its `generator` property has never been evaluated.
"""

from __future__ import annotations

import httpx
import pytest

from rag.api.app import create_app
from tests.rag.live_server import serving

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

FREEZER = "What temperature is the -80 freezer alarm set to?"


def _ask(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json={"question": FREEZER, "k": 3, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=300)


def test_an_extracting_service_starts_and_answers_without_loading_the_generator(lab_rag):
    key = lab_rag.identity.create_key("alice", ["genomics"])
    app = create_app(lab_rag.settings)  # answer_mode "auto" with the packaged SmolLM2: extract
    with serving(app) as url:
        rag = app.state.rag
        assert rag.answer_mode == "extract"
        assert "generator" not in rag.__dict__  # start-up loaded the retrieval models only
        assert "reranker" in rag.__dict__  # extraction scores sentences with it: loaded before traffic
        ready = httpx.get(f"{url}/readyz", timeout=30).json()
        answer = _ask(url, key)
        chat = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                          json={"model": "default", "messages": [{"role": "user", "content": FREEZER}]})
        assert "generator" not in rag.__dict__  # nor did answering a query and a chat
    assert ready["ready"] is True and ready["generator"] == "not needed (answers are extracted)"
    assert answer.status_code == 200 and answer.json()["answer_mode"] == "extract"
    assert "-65 C" in answer.json()["answer"]
    assert chat.status_code == 200 and "-65 C" in chat.json()["choices"][0]["message"]["content"]


def test_a_generating_service_loads_the_generator_before_taking_traffic(lab_rag):
    key = lab_rag.identity.create_key("alice", ["genomics"])
    app = create_app(lab_rag.settings.model_copy(update={"answer_mode": "generate"}))
    with serving(app) as url:
        rag = app.state.rag
        assert rag.answer_mode == "generate"
        assert "generator" in rag.__dict__  # loaded by the lifespan, not by the first request
        answer = _ask(url, key, **{"k": 1})
    body = answer.json()
    assert answer.status_code == 200 and body["answer_mode"] == "generate" and body["answer"]


def test_without_preload_a_generating_service_loads_the_generator_on_the_first_answer(lab_rag):
    key = lab_rag.identity.create_key("alice", ["genomics"])
    app = create_app(lab_rag.settings.model_copy(update={"answer_mode": "generate"}), preload=False)
    with serving(app) as url:
        rag = app.state.rag
        assert "generator" not in rag.__dict__
        retrieval_only = _ask(url, key, generate=False)
        assert "generator" not in rag.__dict__  # retrieval alone never needs it
        answer = _ask(url, key, k=1)
        assert "generator" in rag.__dict__
    assert retrieval_only.status_code == 200 and retrieval_only.json()["answer"] is None
    assert answer.status_code == 200 and answer.json()["answer_mode"] == "generate" and answer.json()["answer"]


def test_a_server_process_freezes_its_start_up_heap_once_loaded(lab_rag):
    # `rag serve` asks for it (freeze_heap=True): models and modules leave the collector, so a
    # full GC's pause (~0.3 s on the H200 host) no longer lands inside a request. Answers are unchanged.
    import gc

    key = lab_rag.identity.create_key("alice", ["genomics"])
    assert gc.get_freeze_count() == 0
    try:
        with serving(create_app(lab_rag.settings, freeze_heap=True)) as url:
            frozen = gc.get_freeze_count()
            answer = _ask(url, key)
        assert frozen > 10_000  # torch, transformers and the retrieval models, at least
        assert answer.status_code == 200 and "-65 C" in answer.json()["answer"]
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    with serving(create_app(lab_rag.settings)) as url:  # the default (tests, notebooks): nothing frozen
        assert gc.get_freeze_count() == 0
