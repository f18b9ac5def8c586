"""/metrics exports the engine's host KV tier counters (EngineConfig.host_kv_blocks), from a real tiny engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from generation import LLM, SamplingParams
from rag.admission import AdmissionControl
from rag.api.observability import _StateCollector
from tests.generation.conftest import build_tiny_model


def scrape(app: FastAPI) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(_StateCollector(app))
    lines = generate_latest(registry).decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}


def test_host_tier_counters_reach_the_metrics_scrape(tmp_path):
    build_tiny_model(tmp_path)
    llm = LLM(tmp_path, device="cpu", dtype=torch.float32, block_size=4, max_model_len=40, num_kv_blocks=12,
              host_kv_blocks=16)  # fmt: skip
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = list(range(10, 27))
    # The prompt's second run hits its blocks (a use: admitted to the host tier); the fillers,
    # each seen once, are not admitted, push the prompt's blocks to the host, and it comes back.
    for ids in [prompt, prompt, *(list(range(30 + 20 * k, 47 + 20 * k)) for k in range(3)), prompt]:
        llm.generate([ids], one, "ns")
    m = llm.metrics()
    assert m.host_kv_hits > 0 and m.host_kv_swapped_out > 0 and m.host_kv_not_admitted > 0
    app = FastAPI()
    # The collector reads the loaded generator from the service's __dict__: a namespace holds it.
    app.state.rag = SimpleNamespace(admission=AdmissionControl(1, 1), generator=llm)
    got = scrape(app)
    assert got["rag_engine_host_kv_hits_total"] == m.host_kv_hits
    assert got["rag_engine_host_kv_swapped_out_total"] == m.host_kv_swapped_out
    assert got["rag_engine_host_kv_swapped_in_total"] == m.host_kv_swapped_in
    assert got["rag_engine_host_kv_not_admitted_total"] == m.host_kv_not_admitted
    assert got["rag_engine_host_kv_blocks_used"] == m.host_kv_blocks_used > 0
