"""Faults in the query service: an engine that dies gives 503 (and /readyz says so), never a hang.

The service runs over real HTTP (uvicorn on loopback, in this process so the test can break the
real engine's step function: the injected fault) with the packaged models.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from rag.api.app import create_app
from tests.rag.live_server import serving


@pytest.fixture(scope="module")
def live(lab_rag):
    settings = lab_rag.settings.model_copy(update={
        "device": "cpu", "max_new_tokens": 8, "engine_num_kv_blocks": 256, "engine_max_num_seqs": 2,
        "top_k": 2, "request_timeout": 120.0,
        "answer_mode": "generate"})  # the engine's path (the packaged model would answer by extraction)
    app = create_app(settings)
    key = lab_rag.identity.create_key("bob", ["imaging"])
    with serving(app) as url:
        yield app, url, key


@pytest.mark.slow
def test_engine_failure_is_503_and_readyz_says_so_and_retrieval_goes_on(live):
    app, url, key = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "Which GPU nodes can I use?"}]
    assert client.chat.completions.create(model="default", messages=question).choices[0].message.content
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200

    engine = app.state.rag.generator.engine.engine

    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.step = broken_step
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="default", messages=question)
    assert err.value.status_code == 503 and time.monotonic() - started < 60
    assert err.value.body["type"] == "service_unavailable" and "illegal memory" not in str(err.value.body)
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json()["ready"] is False
    # Later generations fail at once, the stream variant too; retrieval-only queries still work.
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="default", messages=question)
    retrieval = httpx.post(f"{url}/v1/query", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json={"question": "Which GPU nodes can I use?", "generate": False})
    assert retrieval.status_code == 200 and retrieval.json()["citations"]
