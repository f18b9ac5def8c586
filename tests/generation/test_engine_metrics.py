"""Engine metrics: latency statistics, and queue / KV / prefix-cache counters of a running engine."""

from __future__ import annotations

import pytest

from generation import SamplingParams
from generation.config import EngineConfig
from generation.engine.llm_engine import LLMEngine
from generation.engine.metrics import TTFT_BUCKETS, EngineMetrics, LatencyStats


def test_ttft_and_inter_token_latencies_of_one_request():
    metrics = EngineMetrics()
    metrics.on_arrival(7, 10.0)
    for t in (11.0, 11.5, 12.5):
        metrics.on_token(7, t)
    assert metrics.request_metrics(7).time_to_first_token == 1.0
    done = metrics.on_finish(7)
    assert (done.time_to_first_token, done.mean_inter_token_latency, done.num_output_tokens) == (1.0, 0.75, 3)
    assert metrics.time_to_first_token() == LatencyStats(1, 1.0, 1.0, 1.0)
    assert metrics.inter_token_latency() == LatencyStats(2, 0.75, 0.5, 1.0)
    assert metrics.num_requests_finished == 1 and metrics.num_generated_tokens == 3
    assert metrics.on_finish(7) is None  # forgotten once finished


def test_percentiles_are_nearest_rank_over_a_bounded_window():
    stats = LatencyStats.of(float(v) for v in range(100, 0, -1))
    assert (stats.count, stats.mean, stats.p50, stats.p99) == (100, 50.5, 50.0, 99.0)
    metrics = EngineMetrics(window=3)
    for rid in range(5):
        metrics.on_arrival(rid, 0.0)
        metrics.on_token(rid, float(rid))
    assert metrics.time_to_first_token() == LatencyStats(3, 3.0, 3.0, 4.0)  # only the last three
    assert LatencyStats.of([]) == LatencyStats()
    with pytest.raises(ValueError, match="window"):
        EngineMetrics(window=0)


def test_ttft_histogram_counts_every_first_token_since_start_in_cumulative_buckets():
    metrics = EngineMetrics(window=2)  # the window bounds the percentiles, never the histogram
    # TTFTs 0.001 (on a bound: counted at or below it), 0.05, 0.3, 3.0 and 5000 (past the last bound).
    for rid, ttft in enumerate((0.001, 0.05, 0.3, 3.0, 5000.0)):
        metrics.on_arrival(rid, 0.0)
        metrics.on_token(rid, ttft)
        metrics.on_token(rid, ttft + 100.0)  # later tokens add nothing
    h = metrics.time_to_first_token_histogram()
    assert h.bounds == TTFT_BUCKETS and h.count == 5
    assert h.sum == pytest.approx(0.001 + 0.05 + 0.3 + 3.0 + 5000.0)
    le = dict(zip(h.bounds, h.counts, strict=True))
    assert (le[0.001], le[0.04], le[0.06], le[0.25], le[0.5], le[2.5], le[5.0], le[2560.0]) == (1, 1, 2, 2, 3, 3, 4, 4)
    assert list(h.counts) == sorted(h.counts)  # cumulative


def test_aborted_requests_leave_no_latency_state():
    metrics = EngineMetrics()
    metrics.on_arrival(1, 0.0)
    metrics.on_token(1, 0.5)
    metrics.on_abort(1)
    assert metrics.request_metrics(1) is None and metrics.on_finish(1) is None
    assert metrics.num_requests_finished == 0


def test_engine_counters_follow_requests_through_their_life(tiny_model_factory):
    path, _ = tiny_model_factory("default")
    engine = LLMEngine(path, EngineConfig(device="cpu", block_size=4, max_num_seqs=2, num_kv_blocks=64))
    prompt = list(range(10, 30))
    lengths = (5, 3, 4)
    for n in lengths:
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    m = engine.get_metrics()
    assert (m.num_running, m.num_waiting, m.num_kv_blocks_used, m.num_kv_blocks) == (0, 3, 0, 64)

    engine.step()
    m = engine.get_metrics()
    assert (m.num_running, m.num_waiting) == (2, 1)  # max_num_seqs=2 keeps the third waiting
    assert m.num_kv_blocks_used > 0 and m.num_kv_blocks_used + m.num_kv_blocks_free == 64
    assert m.time_to_first_token.count == 2

    while engine.has_unfinished_requests():
        engine.step()
    m = engine.get_metrics()
    assert (m.num_running, m.num_waiting, m.num_kv_blocks_used) == (0, 0, 0)
    assert m.num_requests_finished == 3 and m.num_generated_tokens == sum(lengths)
    assert m.time_to_first_token.count == 3
    assert m.time_to_first_token_histogram.count == 3 and m.time_to_first_token_histogram.sum > 0
    assert m.inter_token_latency.count == sum(n - 1 for n in lengths)
    assert m.inter_token_latency.p99 >= m.inter_token_latency.p50 > 0
    # The same 20-token prompt three times: the first two were admitted together (no hits yet),
    # the third reused 4 blocks of 4.
    assert m.prefix_cache_queried_tokens == 60 and m.prefix_cache_hit_tokens == 16
    assert m.prefix_cache_hit_rate == pytest.approx(16 / 60)
