"""RAG traffic against the engine's KV reuse modes: no cache, exact prefix (rank / cache-aware order), chunk reuse.

Issue 16's benchmark. A corpus of chunks (random token ids, ~512 tokens each), skewed retrieval
(RAGCache's setting: 3% of the chunks get 60% of the retrievals, the rest uniform), 5 sources per
request, 64-token questions, 128-token answers (ignore_eos), on a Llama-3.1-8B-shaped model with
random bf16 weights. In one run, for each mode:

    no-cache        prefix caching off; sources in rank order
    exact-rank      exact prefix cache, sources in rank order (what a naive pipeline gives
                    vLLM's automatic prefix cache)
    exact-aware     exact prefix cache, sources ordered greedily by the cached prefix they extend
                    (LLMEngine.num_cached_prefix_tokens; ties by rank)
    chunks          kv_reuse="chunks": each chunk's KV computed once after the head and reused at
                    any position (first block recomputed), labels and question recomputed

and for each load: "seq" (one request at a time: time to first token alone), Poisson arrivals at
each --rates value (requests/s), and "offline" (everything queued at once: throughput). Each
mode starts from an empty cache and is warmed with --warmup requests of the same stream first.
Printed: p50/p99 TTFT, output tokens/s, prefix-cache and chunk-cache hit rates, and the ideal
speed-up of the stream: prompt tokens / tokens that must still be computed (first sight of a
chunk, recomputed first blocks, labels, question) with an unbounded cache. Ratios are against
no-cache in the same run. The host-memory tier (issue 16.5) is not built yet: its rows say so.

    python bench/rag_kv_reuse.py                       # H200: the issue's sizes
    python bench/rag_kv_reuse.py --dry-run             # CPU: a tiny random model, small sizes
    python bench/rag_kv_reuse.py --rates 2,4 --requests 300 --warmup 300 --folder /tmp/llama8b
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from generation.config import EngineConfig  # noqa: E402
from generation.engine.llm_engine import LLMEngine  # noqa: E402
from generation.engine.prompt_segments import PromptSegment  # noqa: E402
from generation.sampling_params import SamplingParams  # noqa: E402

MODES = ("no-cache", "exact-rank", "exact-aware", "chunks")


@dataclass(frozen=True)
class Sizes:
    num_chunks: int
    chunk_tokens: int
    sources: int
    question_tokens: int
    answer_tokens: int
    head_tokens: int
    label_tokens: int  # one block: "[k] " padded


ISSUE = Sizes(10_000, 512, 5, 64, 128, 64, 16)
DRY = Sizes(120, 32, 3, 8, 4, 16, 8)


@dataclass(frozen=True)
class Request:
    chunk_ids: tuple[int, ...]  # best first (rank order)
    question: tuple[int, ...]


class Corpus:
    """Random token ids for the head, the chunks, labels and questions; skewed chunk popularity."""

    def __init__(self, sizes: Sizes, vocab: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.sizes = sizes
        token = lambda: rng.randrange(10, vocab)  # noqa: E731 (a few low ids left for specials)
        self.head = [token() for _ in range(sizes.head_tokens)]
        self.chunks = [[token() for _ in range(sizes.chunk_tokens)] for _ in range(sizes.num_chunks)]
        self.labels = [[token() for _ in range(sizes.label_tokens)] for _ in range(sizes.sources)]
        self.hot = max(1, round(0.03 * sizes.num_chunks))  # 3% of the chunks ...
        self._rng = rng

    def draw_chunk(self) -> int:
        # ... get 60% of the retrievals; the rest are uniform over the cold 97%.
        if self._rng.random() < 0.6:
            return self._rng.randrange(self.hot)
        return self._rng.randrange(self.hot, self.sizes.num_chunks)

    def requests(self, n: int) -> list[Request]:
        out = []
        for _ in range(n):
            chosen: list[int] = []
            while len(chosen) < self.sizes.sources:
                c = self.draw_chunk()
                if c not in chosen:
                    chosen.append(c)
            question = tuple(self._rng.randrange(10, 1000) for _ in range(self.sizes.question_tokens))
            out.append(Request(tuple(chosen), question))
        return out


def ideal_speedup(corpus: Corpus, stream: list[Request], mode: str) -> float:
    """Prompt tokens / tokens still computed with an unbounded cache, over the whole stream.

    exact-aware is estimated with one canonical (sorted) order: the sharing a cache-aware order
    can reach at best when every earlier prompt is cached.
    """
    s = corpus.sizes
    seen: set = set()
    total = computed = 0
    for req in stream:
        prompt = s.head_tokens + s.sources * (s.label_tokens + s.chunk_tokens) + s.question_tokens
        total += prompt
        if mode == "no-cache":
            computed += prompt
            continue
        if mode == "chunks":
            fresh = s.head_tokens if "head" not in seen else 0
            seen.add("head")
            for c in req.chunk_ids:
                fresh += s.label_tokens + (s.chunk_tokens if c not in seen else min(16, s.chunk_tokens))
                seen.add(c)
            computed += fresh + s.question_tokens
            continue
        # Exact prefix: the longest prefix of (head, sources in order) seen before, as a trie path.
        order = req.chunk_ids if mode == "exact-rank" else tuple(sorted(req.chunk_ids))
        path: tuple = ()
        fresh = 0 if ("head",) in seen else s.head_tokens
        seen.add(("head",))
        for c in order:
            path = (*path, c)
            if path not in seen:
                fresh += s.label_tokens + s.chunk_tokens
                seen.add(path)
        computed += fresh + s.question_tokens
    return total / computed


# --------------------------------------------------------------------------------------------------
# Prompts per mode
# --------------------------------------------------------------------------------------------------


def flat_prompt(corpus: Corpus, order: tuple[int, ...], question: tuple[int, ...]) -> list[int]:
    ids = list(corpus.head)
    for k, c in enumerate(order):
        ids += corpus.labels[k] + corpus.chunks[c]
    return ids + list(question)


def cache_aware_order(engine: LLMEngine, corpus: Corpus, req: Request) -> tuple[int, ...]:
    """Greedy: next the source whose addition the prefix cache holds the most of; ties by rank."""
    order: list[int] = []
    prefix = list(corpus.head)
    remaining = list(req.chunk_ids)
    while remaining:
        k = len(order)
        label = corpus.labels[k]
        best = max(remaining, key=lambda c: (engine.num_cached_prefix_tokens(prefix + label + corpus.chunks[c]),
                                             -req.chunk_ids.index(c)))  # fmt: skip
        order.append(best)
        remaining.remove(best)
        prefix += corpus.labels[k] + corpus.chunks[best]
    return tuple(order)


def segments(corpus: Corpus, req: Request) -> list[PromptSegment]:
    out = [PromptSegment.of("head", corpus.head, "system")]
    for k, c in enumerate(req.chunk_ids):
        out.append(PromptSegment.of("label", corpus.labels[k], "user"))
        out.append(PromptSegment.of("chunk", corpus.chunks[c], "acl:docs"))
    return [*out, PromptSegment.of("suffix", req.question, "user")]


def submit(engine: LLMEngine, corpus: Corpus, mode: str, req: Request, params: SamplingParams) -> int:
    if mode == "chunks":
        return engine.add_segmented_request(segments(corpus, req), params, incremental_text=False)
    order = cache_aware_order(engine, corpus, req) if mode == "exact-aware" else req.chunk_ids
    return engine.add_request(flat_prompt(corpus, order, req.question), params, "docs", incremental_text=False)


# --------------------------------------------------------------------------------------------------
# Loads
# --------------------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    ttft: list[float]
    output_tokens: int
    seconds: float


def run_load(engine: LLMEngine, corpus: Corpus, mode: str, stream: list[Request], load: str,
             params: SamplingParams, seed: int = 1) -> LoadResult:  # fmt: skip
    """Serve the stream under one load; TTFT from each request's arrival time."""
    rng = random.Random(seed)
    if load == "offline":
        arrivals = [0.0] * len(stream)
    elif load == "seq":
        arrivals = []
    else:
        rate, t, arrivals = float(load), 0.0, []
        for _ in stream:
            t += rng.expovariate(rate)
            arrivals.append(t)
    ttft: list[float] = []
    out_tokens = 0
    start = time.monotonic()
    if load == "seq":
        for req in stream:
            rid = submit(engine, corpus, mode, req, params)
            done = False
            while not done:
                for u in engine.step():
                    out_tokens += len(u.new_token_ids)
                    if u.request_id == rid and u.finished:
                        ttft.append(u.metrics.time_to_first_token)
                        done = True
        return LoadResult(ttft, out_tokens, time.monotonic() - start)
    pending = 0
    finished = 0
    while finished < len(stream):
        now = time.monotonic() - start
        # Queue everything that has arrived by now (arrival times are sorted).
        while pending < len(stream) and arrivals[pending] <= now:
            submit(engine, corpus, mode, stream[pending], params)
            pending += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        for u in engine.step():
            out_tokens += len(u.new_token_ids)
            if u.finished:
                finished += 1
                # The engine's arrival is when submit ran, at most one step after the Poisson time.
                ttft.append(u.metrics.time_to_first_token)
    return LoadResult(ttft, out_tokens, time.monotonic() - start)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def make_folder(dry: bool, folder: Path | None) -> Path:
    if folder is not None and (folder / "config.json").is_file():
        return folder
    folder = folder or Path(tempfile.mkdtemp(prefix="rag-kv-reuse-"))
    folder.mkdir(parents=True, exist_ok=True)
    if dry:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128}  # fmt: skip
        config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             rope_scaling=rope)  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        from bench.engine_llama8b import make_model

        make_model(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny random model and sizes: checks the script runs")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--rates", default="2,4,8", help="Poisson arrival rates in requests/s (default 2,4,8)")
    ap.add_argument("--loads", default="seq,rates,offline", help="which of seq, rates, offline to run")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per load (default 200; dry 12)")
    ap.add_argument("--warmup", type=int, default=None, help="requests served first to warm each cache (default 400)")
    ap.add_argument("--folder", type=Path, default=None, help="reuse (or write) the random model folder here")
    args = ap.parse_args()
    sizes = DRY if args.dry_run else ISSUE
    n = args.requests or (12 if args.dry_run else 200)
    warm = args.warmup if args.warmup is not None else (12 if args.dry_run else 400)
    device = "cpu" if args.dry_run else "cuda"
    folder = make_folder(args.dry_run, args.folder)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    loads = []
    for part in args.loads.split(","):
        loads += [r for r in args.rates.split(",") if r] if part == "rates" else [part]
    vocab = 1024 if args.dry_run else 128256
    corpus = Corpus(sizes, vocab)
    warm_stream, streams = corpus.requests(warm), {load: corpus.requests(n) for load in loads}
    params = SamplingParams(max_tokens=sizes.answer_tokens, ignore_eos=True)
    hw = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# rag_kv_reuse: {hw}, {datetime.date.today()}, {sizes.num_chunks} chunks x {sizes.chunk_tokens} tokens, "
          f"{sizes.sources} sources, {sizes.question_tokens}-token questions, {sizes.answer_tokens}-token answers, "
          f"{n} requests per load after {warm} warm-up")  # fmt: skip
    results: dict[tuple[str, str], tuple[LoadResult, dict]] = {}
    for mode in modes:
        config = EngineConfig(
            device=device, dtype="bfloat16" if device == "cuda" else "float32",
            enable_prefix_caching=mode != "no-cache", kv_reuse="chunks" if mode == "chunks" else "exact",
            max_model_len=8192 if not args.dry_run else 512, num_kv_blocks=2048 if args.dry_run else None,
        )  # fmt: skip
        engine = LLMEngine(folder, config)
        for load in loads:
            engine.block_manager.reset_prefix_cache()
            run_load(engine, corpus, mode, warm_stream, "offline", params)
            before = engine.get_metrics()
            result = run_load(engine, corpus, mode, streams[load], load, params)
            after = engine.get_metrics()
            counters = {
                "prefix_hit": (after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens)
                / max(1, after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens),
                "chunk_hits": after.chunk_cache_hits - before.chunk_cache_hits,
                "chunk_misses": after.chunk_cache_misses - before.chunk_cache_misses,
                "computed": after.prompt_computed_tokens - before.prompt_computed_tokens,
                "reused": after.chunk_reused_tokens - before.chunk_reused_tokens,
            }
            results[(mode, load)] = (result, counters)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n| mode | load | p50 TTFT ms | p99 TTFT ms | p50 vs no-cache | output tok/s | vs no-cache | prefix hit "
          "| chunk hits/misses | prompt tokens computed | ideal speed-up |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for load in loads:
        base = results.get(("no-cache", load))
        for mode in modes:
            r, c = results[(mode, load)]
            p50, p99 = percentile(r.ttft, 0.5) * 1e3, percentile(r.ttft, 0.99) * 1e3
            tput = r.output_tokens / r.seconds
            rel_ttft = f"{percentile(base[0].ttft, 0.5) * 1e3 / p50:.2f}x" if base else "-"
            rel_tput = f"{tput / (base[0].output_tokens / base[0].seconds):.2f}x" if base else "-"
            ideal = ideal_speedup(corpus, warm_stream + streams[load], mode)
            hits = f"{c['chunk_hits']}/{c['chunk_misses']}"
            print(f"| {mode} | {load} | {p50:.1f} | {p99:.1f} | {rel_ttft} | {tput:.0f} | {rel_tput} | "
                  f"{c['prefix_hit']:.2f} | {hits} | {c['computed']} | {ideal:.2f}x |")  # fmt: skip
    print("\nhost tier: not built yet (issue 16.5); every mode above runs without it.")
    print(f"mean TTFT over all loads: {statistics.fmean(t for r, _ in results.values() for t in r.ttft) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
