"""The local engine's counters as Prometheus metric families: one table for `rag serve` and `rag engine serve`.

Both servers export the same names (prefixed `rag_engine_`), so one dashboard and one autoscaler
rule read either. What an autoscaler needs: `rag_engine_num_requests_waiting` (and, on `rag serve`,
`rag_admission_queued`), `rag_engine_num_requests_running`, `rag_engine_kv_cache_usage_ratio`
(0..1) and the `rag_engine_time_to_first_token_seconds` histogram.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from generation.engine.metrics import MetricsSnapshot

# The local engine's metrics, read at scrape time: (family, name, EngineMetrics field, help).
# The comment on a row names the vLLM metric it mirrors, so dashboards built for vLLM map across.
# Cache behaviour is aggregated over every user: totals only, never per user or per request. The
# chunk-reuse rows are zero unless kv_reuse="chunks", the host-tier rows unless host_kv_blocks > 0.
ENGINE_METRICS = (
    (GaugeMetricFamily, "rag_engine_num_requests_running", "num_running",
     "sequences in the engine's running batch"),  # vllm:num_requests_running
    (GaugeMetricFamily, "rag_engine_num_requests_waiting", "num_waiting",
     "sequences waiting to be scheduled"),  # vllm:num_requests_waiting
    (GaugeMetricFamily, "rag_engine_kv_blocks_used", "num_kv_blocks_used",
     "KV-cache blocks referenced by running sequences"),
    (GaugeMetricFamily, "rag_engine_kv_blocks_free", "num_kv_blocks_free",
     "KV-cache blocks free or holding evictable cached prefixes"),
    (GaugeMetricFamily, "rag_engine_kv_cache_usage_ratio", "kv_cache_usage",
     "fraction of KV-cache blocks in use"),  # vllm:kv_cache_usage_perc (a 0-1 fraction)
    (GaugeMetricFamily, "rag_engine_prefix_cache_hit_rate", "prefix_cache_hit_rate",
     "prompt tokens served from the prefix cache / looked up, since start"),  # vllm:gpu_prefix_cache_hit_rate (vLLM v0)
    (CounterMetricFamily, "rag_engine_prefix_cache_queries", "prefix_cache_queried_tokens",
     "prompt tokens looked up in the prefix cache"),  # vllm:prefix_cache_queries (tokens)
    (CounterMetricFamily, "rag_engine_prefix_cache_hits", "prefix_cache_hit_tokens",
     "prompt tokens served from the prefix cache"),  # vllm:prefix_cache_hits (tokens)
    (CounterMetricFamily, "rag_engine_num_preemptions", "num_preemptions",
     "sequences preempted for KV blocks"),  # vllm:num_preemptions
    (CounterMetricFamily, "rag_engine_batches_stopped_early", "num_batches_stopped_early",
     "multi-step decode batches ended early so that a waiting request could join"),
    (CounterMetricFamily, "rag_engine_steps_skipped", "num_steps_skipped",
     "decode steps of multi-step batches not run because the batch stopped early"),
    (CounterMetricFamily, "rag_engine_request_success", "num_requests_finished",
     "requests the engine finished"),  # vllm:request_success
    (CounterMetricFamily, "rag_engine_generation_tokens", "num_generated_tokens",
     "tokens the engine generated"),  # vllm:generation_tokens
    (CounterMetricFamily, "rag_engine_prompt_computed_tokens", "prompt_computed_tokens",
     "prompt tokens the engine computed (prefill, chunk compiles)"),  # vllm:prompt_tokens counts all
    (CounterMetricFamily, "rag_engine_chunk_reused_tokens", "chunk_reused_tokens",
     "prompt tokens whose KV was copied from a cached chunk"),
    (CounterMetricFamily, "rag_engine_chunk_cache_hits", "chunk_cache_hits",
     "retrieved chunks whose KV was cached when the request arrived"),
    (CounterMetricFamily, "rag_engine_chunk_cache_misses", "chunk_cache_misses",
     "retrieved chunks whose KV was not cached when the request arrived"),
    (GaugeMetricFamily, "rag_engine_host_kv_blocks_used", "host_kv_blocks_used",
     "KV blocks held in the host-memory tier"),
    (CounterMetricFamily, "rag_engine_host_kv_hits", "host_kv_hits",
     "KV blocks missing on the GPU found in the host tier"),
    (CounterMetricFamily, "rag_engine_host_kv_swapped_out", "host_kv_swapped_out",
     "KV blocks copied from the GPU to the host tier"),
    (CounterMetricFamily, "rag_engine_host_kv_swapped_in", "host_kv_swapped_in",
     "KV blocks copied from the host tier back to the GPU"),
    (CounterMetricFamily, "rag_engine_host_kv_not_admitted", "host_kv_not_admitted",
     "KV blocks evicted from the GPU that were used too rarely to be copied to the host tier"),
    (CounterMetricFamily, "rag_engine_host_kv_copy_back_hidden", "host_kv_copy_back_hidden",
     "KV blocks copied back from the host tier that landed before a step needed them (CUDA)"),
    (CounterMetricFamily, "rag_engine_host_kv_copy_back_waited", "host_kv_copy_back_waited",
     "KV blocks copied back from the host tier that a step had to wait for (CUDA)"),
)


def engine_metric_families(m: MetricsSnapshot) -> Iterator[Metric]:
    """Every row of ENGINE_METRICS read from one snapshot, then the TTFT histogram."""
    for family, name, field, doc in ENGINE_METRICS:
        # getattr with 0: the chunk-reuse and host-tier fields exist only on engines that have them.
        yield family(name, doc, value=getattr(m, field, 0))
    h = m.time_to_first_token_histogram
    buckets = [(_le(bound), float(count)) for bound, count in zip(h.bounds, h.counts, strict=True)]
    # vllm:time_to_first_token_seconds: from the request's arrival in the engine to its first token.
    yield HistogramMetricFamily(
        "rag_engine_time_to_first_token_seconds", "time from a request's arrival in the engine to its first token",
        buckets=[*buckets, ("+Inf", float(h.count))], sum_value=h.sum)


def _le(bound: float) -> str:
    return repr(float(bound))
