"""EngineMetrics: request latencies (time to first token, inter-token) and snapshots of queue and KV cache state."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate

from generation.engine.copy_landing import CopyLanding
from generation.engine.host_kv_tier import HostKVTier
from generation.engine.scheduler import Scheduler

DEFAULT_WINDOW = 1000  # latency samples kept for the percentiles: recent behaviour, bounded memory
# Upper bounds (seconds) of the TTFT histogram's buckets: vLLM's for vllm:time_to_first_token_seconds,
# so dashboards and autoscaler rules written for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles, in seconds, of the latencies in the window (zeros when it is empty)."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[float]) -> LatencyStats:
        values = sorted(samples)
        if not values:
            return cls()
        return cls(len(values), sum(values) / len(values), _percentile(values, 50), _percentile(values, 99))


@dataclass(frozen=True)
class Histogram:
    """Every observation since start in fixed buckets (Prometheus style), never windowed.

    `counts[i]` is how many observations were <= `bounds[i]`, cumulative; `count` includes those
    above the last bound (the +Inf bucket), `sum` is their total.
    """

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    count: int = 0
    sum: float = 0.0


class _HistogramRecorder:
    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), "bucket bounds must ascend"
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def read(self) -> Histogram:
        # One copy, so the cumulative counts and the total agree even while the step thread observes.
        per_bucket = list(self.buckets)
        return Histogram(self.bounds, tuple(accumulate(per_bucket[:-1])), sum(per_bucket), self.sum)


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one request, in seconds (None until it has produced the tokens they need)."""

    time_to_first_token: float | None
    mean_inter_token_latency: float | None
    num_output_tokens: int


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the service exports: queue lengths, KV blocks, prefix-cache hits and latencies.

    `max_num_running` is the most sequences the scheduler put in one batch since start (decodes
    and prefill chunks together); `prefix_cache_hit_tokens` / `prefix_cache_queried_tokens` count
    prompt tokens served from / looked up in the prefix cache at admission, since start.
    """

    num_running: int
    num_waiting: int
    max_num_running: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_requests_finished: int
    num_generated_tokens: int
    time_to_first_token: LatencyStats
    inter_token_latency: LatencyStats
    # Reuse against compute, since start: prompt tokens fed to the model (prefill runs, chunk
    # compiles included), and tokens whose KV was copied from a cached chunk (kv_reuse="chunks").
    prompt_computed_tokens: int = 0
    chunk_reused_tokens: int = 0
    # Chunk lookups at a request's arrival: the chunk's canonical KV was cached, or not (computed
    # in place with chunk_miss="in_place", compiled first with "wait").
    chunk_cache_hits: int = 0
    chunk_cache_misses: int = 0
    # Chunks computed inside the prompt instead (missed with "in_place", not block-aligned, or
    # evicted before admission).
    chunks_computed_in_place: int = 0
    # Host tier (EngineConfig.host_kv_blocks; zeros when off): its size and blocks held now, GPU
    # misses it served, blocks copied out / back since start, its own evictions, and evicted GPU
    # blocks it did not take (used fewer than host_kv_admit_uses times).
    host_kv_blocks: int = 0
    host_kv_blocks_used: int = 0
    host_kv_hits: int = 0
    host_kv_swapped_out: int = 0
    host_kv_swapped_in: int = 0
    host_kv_evictions: int = 0
    host_kv_not_admitted: int = 0
    # Blocks copied back on the GPU's copy stream (CUDA only) that had landed before a step needed
    # them (hidden behind other work) and those a step or copy out had to wait for.
    host_kv_copy_back_hidden: int = 0
    host_kv_copy_back_waited: int = 0
    # Multi-step decode batches ended before their planned last step so that a waiting request
    # could join (LLMEngine.step's stop_early), and the planned steps that were not run.
    num_batches_stopped_early: int = 0
    num_steps_skipped: int = 0
    # Every request's time to first token since start, in TTFT_BUCKETS (not windowed: what a
    # Prometheus histogram needs; its count is the requests that produced a first token).
    time_to_first_token_histogram: Histogram = field(default_factory=Histogram)


class _RequestTimes:
    __slots__ = ("arrival", "first_token", "last_token", "num_tokens", "itl_sum")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.itl_sum = 0.0


class EngineMetrics:
    """Records request events (times from the caller's clock) and summarises them.

    Args:
        window: latency samples kept for means and percentiles (the most recent ones).
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._requests: dict[int, _RequestTimes] = {}
        self._ttft: deque[float] = deque(maxlen=window)
        self._itl: deque[float] = deque(maxlen=window)
        self._ttft_histogram = _HistogramRecorder(TTFT_BUCKETS)
        self.num_requests_finished = 0
        self.num_generated_tokens = 0
        self.num_batches_stopped_early = 0
        self.num_steps_skipped = 0

    def on_arrival(self, request_id: int, now: float) -> None:
        self._requests[request_id] = _RequestTimes(now)

    def on_token(self, request_id: int, now: float) -> None:
        """A request produced one token at `now`: its first gives the TTFT, later ones an inter-token gap."""
        times = self._requests.get(request_id)
        if times is None:
            return
        if times.first_token is None:
            times.first_token = now
            self._ttft.append(now - times.arrival)
            self._ttft_histogram.observe(now - times.arrival)
        else:
            assert times.last_token is not None
            gap = now - times.last_token
            self._itl.append(gap)
            times.itl_sum += gap
        times.last_token = now
        times.num_tokens += 1
        self.num_generated_tokens += 1

    def on_finish(self, request_id: int) -> RequestMetrics | None:
        """Forget a finished request; returns its latencies."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return None
        self.num_requests_finished += 1
        return _request_metrics(times)

    def on_abort(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def request_metrics(self, request_id: int) -> RequestMetrics | None:
        """Latencies so far of a request still in flight (None if unknown)."""
        times = self._requests.get(request_id)
        return _request_metrics(times) if times is not None else None

    def time_to_first_token(self) -> LatencyStats:
        return LatencyStats.of(self._ttft)

    def inter_token_latency(self) -> LatencyStats:
        return LatencyStats.of(self._itl)

    def time_to_first_token_histogram(self) -> Histogram:
        """Every TTFT since start, in TTFT_BUCKETS."""
        return self._ttft_histogram.read()

    def snapshot(self, scheduler: Scheduler) -> MetricsSnapshot:
        """Current counters of the scheduler, its block manager and these latencies."""
        bm = scheduler.block_manager
        planner = scheduler.chunk_planner
        return MetricsSnapshot(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            max_num_running=scheduler.max_num_running,
            num_kv_blocks=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queried_tokens=bm.num_queried_tokens,
            prefix_cache_hit_tokens=bm.num_hit_tokens,
            prefix_cache_hit_rate=bm.hit_rate,
            num_preemptions=scheduler.num_preemptions,
            num_requests_finished=self.num_requests_finished,
            num_generated_tokens=self.num_generated_tokens,
            time_to_first_token=self.time_to_first_token(),
            inter_token_latency=self.inter_token_latency(),
            prompt_computed_tokens=scheduler.num_computed_prompt_tokens,
            chunk_reused_tokens=planner.num_reused_tokens if planner is not None else 0,
            chunk_cache_hits=planner.num_chunk_hits if planner is not None else 0,
            chunk_cache_misses=planner.num_chunk_misses if planner is not None else 0,
            chunks_computed_in_place=planner.num_chunks_in_place if planner is not None else 0,
            **_host_tier_counters(bm.host_tier),
            num_batches_stopped_early=self.num_batches_stopped_early,
            num_steps_skipped=self.num_steps_skipped,
            time_to_first_token_histogram=self.time_to_first_token_histogram(),
        )


def _host_tier_counters(host: HostKVTier | None) -> dict[str, int]:
    if host is None:
        return {}
    return {
        "host_kv_blocks": host.capacity,
        "host_kv_blocks_used": host.num_used_blocks,
        "host_kv_hits": host.num_hits,
        "host_kv_swapped_out": host.num_swapped_out,
        "host_kv_swapped_in": host.num_swapped_in,
        "host_kv_evictions": host.num_evictions,
        "host_kv_not_admitted": host.num_not_admitted,
        **_copy_back_counters(getattr(host.copier, "landing", None)),
    }


def _copy_back_counters(landing: CopyLanding | None) -> dict[str, int]:
    # Only HostKVBuffer overlaps its copies back (and only on CUDA); other copiers have no landing.
    if landing is None:
        return {}
    return {
        "host_kv_copy_back_hidden": landing.num_hidden_blocks,
        "host_kv_copy_back_waited": landing.num_waited_blocks,
    }


def _request_metrics(times: _RequestTimes) -> RequestMetrics:
    ttft = times.first_token - times.arrival if times.first_token is not None else None
    gaps = times.num_tokens - 1
    return RequestMetrics(ttft, times.itl_sum / gaps if gaps > 0 else None, times.num_tokens)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list: the smallest value with at least q% at or below it."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]
