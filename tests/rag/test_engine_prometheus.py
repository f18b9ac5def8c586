"""rag/engine_prometheus.py: the engine's snapshot as Prometheus text, the TTFT histogram's buckets included."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from generation.engine.metrics import EngineMetrics
from rag.engine_prometheus import engine_metric_families


class _Stub:
    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot

    def collect(self):
        return engine_metric_families(self.snapshot)


def _samples(snapshot) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Stub(snapshot))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_autoscaler_gauges_and_the_ttft_histogram(tiny_engine_snapshot):
    got = _samples(tiny_engine_snapshot)
    m = tiny_engine_snapshot
    assert got[("rag_engine_num_requests_waiting", ())] == m.num_waiting == 1
    assert got[("rag_engine_num_requests_running", ())] == m.num_running == 2
    assert got[("rag_engine_kv_cache_usage_ratio", ())] == m.kv_cache_usage > 0
    h = m.time_to_first_token_histogram
    assert got[("rag_engine_time_to_first_token_seconds_count", ())] == h.count == 2
    assert got[("rag_engine_time_to_first_token_seconds_sum", ())] == h.sum
    assert got[("rag_engine_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("rag_engine_time_to_first_token_seconds_bucket", (("le", "0.001"),))] == h.counts[0]
    assert got[("rag_engine_time_to_first_token_seconds_bucket", (("le", "2560.0"),))] == h.counts[-1]


def test_an_idle_engine_exports_an_empty_histogram():
    from types import SimpleNamespace

    metrics = EngineMetrics()
    stub = SimpleNamespace(time_to_first_token_histogram=metrics.time_to_first_token_histogram())
    got = _samples(stub)
    assert got[("rag_engine_time_to_first_token_seconds_count", ())] == 0
    assert got[("rag_engine_num_requests_waiting", ())] == 0  # fields the stub lacks read as 0


@pytest.fixture(scope="module")
def tiny_engine_snapshot(tmp_path_factory):
    """A tiny CPU engine one step into three requests (two running, one waiting)."""
    from generation import SamplingParams
    from generation.config import EngineConfig
    from generation.engine.llm_engine import LLMEngine
    from tests.generation.conftest import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-prom")
    build_tiny_model(path)
    engine = LLMEngine(path, EngineConfig(device="cpu", block_size=4, max_num_seqs=2, num_kv_blocks=64))
    for _ in range(3):
        engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    return engine.get_metrics()
