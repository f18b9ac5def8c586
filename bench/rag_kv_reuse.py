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
    chunks          kv_reuse="chunks", chunk_miss="wait": each chunk's KV computed once after the
                    head (the request waits for its misses' compiles) and reused at any position
                    (first block recomputed); labels and question recomputed
    chunks-inplace  kv_reuse="chunks", chunk_miss="in_place": a missed chunk is computed exactly in
                    the request's own prefill, and compiled behind it from its second miss on
    chunks-inplace-rank   the same with the sources in rank order (no lead chosen)
    chunks-inplace-anymiss  ... with no missed chunk that missed before, the first missed one leads
    chunks-inplace-split  ... and label 1 its own segment after the head, as the service's
                    layout had it before: no source sits where a chunk's canonical KV does

In the chunk modes the head ends with label 1 (as `rag.prompt_layout` lays out the service's
prompts), so the first source sits exactly where its chunk's canonical KV `head ‖ chunk` does:
computing it there publishes that KV, and the engine queues no compile for it. The sources are
ordered as the service orders them (`LLMEngine.chunk_to_lead`): a missed chunk that missed
before first ("wait": any missed chunk), the rest in rank order.

A mode name ending in "+host" adds the host-memory tier (--host-kv-blocks); with --gpu-kv-blocks
the GPU pool is made small enough that the popular chunks do not fit in it, which is when the
tier matters (with the H200's whole memory the 8B model's pool holds every popular chunk).
The tier copies hits back on a copy stream of its own, beside the steps that do not read them;
"+host-inline" is the peer that copies them on the compute stream before the next step, as the
tier did before (HostKVBuffer.overlap_copy_back = False). The tier copies out only blocks used on
the GPU (EngineConfig.host_kv_admit_uses = 1: hit at least once, or published by a chunk compile);
"+host-all" is the peer that copies out every published block the GPU evicts, as it did before.
A mode name ending in "+full-batches" runs every multi-step decode batch to its last step, as
the engine did before LLMEngine.step's `arrived`: the server loop here tells the engine when a
request has arrived, and a batch then ends after the steps already launched (the peer row that
shows what that is worth). A mode name ending in "+torch-copy" copies reused chunk KV with the
torch path (a gather, fp32 rotation and scatter per chunk, each waiting on its index copies), as
the engine did before `generation/layers/triton_kv_copy.py` (one launch for all of a step's copies).

Each mode starts from an empty cache and is warmed once by --warmup requests of the same stream,
prefill only (max_tokens=1: the cache holds the same prompt blocks, at a fraction of the time),
then the last 64 of them again with full answers (compiling the decode kernels of every batch
size, which would otherwise slow the first mode's first load); then the loads run in order on
the warm engine, as on a long-running server:

    seq       one request at a time, first token only (max_tokens=1): time to first token alone,
              and its wall time (submit until the engine is idle: the chunk compiles a request
              queues behind itself included, which its TTFT does not wait for)
    offline   everything queued at once: throughput; its requests/s is the mode's capacity
    <rate>    Poisson arrivals at that many requests/s, or "0.9x": 0.9 x no-cache's offline
              capacity measured in the same run (no-cache must run first); --loads "rates"
    slo       the fastest Poisson rate at which the mode meets a TTFT SLO (--slo-ms at
              --slo-quantile, default p99 <= 1 s, and a queue that holds: bench/slo_sweep.py),
              bisected over --slo-range with --slo-probes loads of --slo-requests each

A load ends when its requests have finished; compiles still queued behind them run after that,
untimed, so that each load's counters hold the work its own requests caused.

TTFT counts from each request's arrival (its Poisson time, not when the loop got to submit it).
Printed: p50/p99 TTFT, output tokens/s, prefix-cache and chunk-cache hit rates, host-tier hits
(blocks; in brackets how many of their copies back had landed before a step needed them / a step
waited for), prompt tokens computed, the fewest any run of the mode can compute for the load
("least computable", bench/kv_reuse_bound.py: an unbounded cache under the mode's rules, every
exact prefix counted, the best order where the mode chooses one), the measured share of that ideal
and the ideal speed-up itself (prompt tokens / least computable): no run exceeds 100% of it.
Then the SLO table and the issue's goals, checked; offline throughput against its own ideal, with
decode counted: no-cache's offline burst is run a second time prefill only, and its share f of the
burst's time gives 1 / (f / ideal + 1 - f).
--copy-back times restoring one chunk's blocks from the host tier against recomputing them.

    python bench/rag_kv_reuse.py                       # H200: the issue's sizes
    python bench/rag_kv_reuse.py --dry-run             # CPU: a tiny random model, small sizes
    python bench/rag_kv_reuse.py --loads seq,offline,rates,slo --rates 0.9x --requests 120 --folder /tmp/llama8b
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_reuse_bound import KERNEL_WARMUP, least_computed  # noqa: E402
from bench.slo_sweep import Probe, Slo, crossing, sweep  # noqa: E402
from generation.config import EngineConfig  # noqa: E402
from generation.engine.llm_engine import LLMEngine  # noqa: E402
from generation.engine.prompt_segments import PromptSegment  # noqa: E402
from generation.engine.startup_heap import freeze_startup_heap  # noqa: E402
from generation.layers.kernel_choice import set_kv_copy_kernel  # noqa: E402
from generation.layers.kernel_warmup import recording_triton_compiles  # noqa: E402
from generation.sampling_params import SamplingParams  # noqa: E402
from rag.source_order import lead_with  # noqa: E402

BASE_MODES = ("no-cache", "exact-rank", "exact-aware", "chunks", "chunks-inplace", "chunks-inplace-rank",
              "chunks-inplace-split", "chunks-inplace-anymiss")
SUFFIXES = ("", "+host", "+host-inline", "+host-all", "+full-batches", "+host+full-batches", "+torch-copy")
MODES = tuple(m + x for x in SUFFIXES for m in BASE_MODES if not (m == "no-cache" and "+host" in x))


def base_mode(mode: str) -> str:
    """The mode without its suffixes: "chunks-inplace+host" -> "chunks-inplace"."""
    return mode.split("+", 1)[0]


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
DRY = Sizes(120, 32, 3, 8, 4, 16, 16)  # labels of one block, as in the service's layout


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


def ideal_speedup(corpus: Corpus, history: list[Request], stream: list[Request], mode: str) -> float:
    """Prompt tokens / the fewest a run of the mode can compute over the stream (bench/kv_reuse_bound.py).

    `history` ran before (the warm-up, earlier loads): it fills the cache but is not counted.
    """
    return least_computed(corpus.sizes, history, stream, mode).ideal_speedup


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


def head_segment(corpus: Corpus, split: bool = False) -> PromptSegment:
    """The head: label 1 ends it (as the service lays it out), unless it is its own segment (split)."""
    return PromptSegment.of("head", corpus.head if split else corpus.head + corpus.labels[0], "system")


def chunk_segment(corpus: Corpus, c: int) -> PromptSegment:
    return PromptSegment.of("chunk", corpus.chunks[c], "acl:docs")


def segments(corpus: Corpus, order: tuple[int, ...], question: tuple[int, ...],
             split: bool = False) -> list[PromptSegment]:
    """The segmented prompt: the head, then per source its label (none before the first unless split) and chunk."""
    out = [head_segment(corpus, split)]
    for k, c in enumerate(order):
        if k or split:
            out.append(PromptSegment.of("label", corpus.labels[k], "user"))
        out.append(chunk_segment(corpus, c))
    return [*out, PromptSegment.of("suffix", question, "user")]


def chunk_order(engine: LLMEngine, corpus: Corpus, req: Request, any_miss: bool = False) -> tuple[int, ...]:
    """The service's order (rag.source_order): the chunk the engine names to lead with first, the rest by rank.

    any_miss (chunks-inplace-anymiss): when the engine names none, the first missed chunk leads,
    even one missed for the first time.
    """
    head, chunks = head_segment(corpus), [chunk_segment(corpus, c) for c in req.chunk_ids]
    lead = engine.chunk_to_lead(head, chunks)
    if lead is None and any_miss:
        lead = next((i for i, chunk in enumerate(chunks) if not engine.chunk_planner.is_cached(head, chunk)), None)
    return req.chunk_ids if lead is None else tuple(lead_with(req.chunk_ids, lead))


def submit(engine: LLMEngine, corpus: Corpus, mode: str, req: Request, params: SamplingParams) -> int:
    mode = base_mode(mode)
    if mode.startswith("chunks"):
        ranked = mode in ("chunks-inplace-rank", "chunks-inplace-split")
        order = req.chunk_ids if ranked else chunk_order(engine, corpus, req, mode == "chunks-inplace-anymiss")
        prompt = segments(corpus, order, req.question, split=mode == "chunks-inplace-split")
        return engine.add_segmented_request(prompt, params, incremental_text=False)
    order = cache_aware_order(engine, corpus, req) if mode == "exact-aware" else req.chunk_ids
    return engine.add_request(flat_prompt(corpus, order, req.question), params, "docs", incremental_text=False)


# --------------------------------------------------------------------------------------------------
# Loads
# --------------------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    # (arrival offset from the load's start, TTFT) of each request, in first-token order
    timed: list[tuple[float, float]]
    output_tokens: int
    seconds: float
    requests: int
    # seq only: seconds each request spent in submit() (ordering probes, layout, the engine's
    # planning), host work inside its TTFT before the first step
    submit_seconds: list[float] = field(default_factory=list)
    # seq only: seconds from each request's submit() until the engine was idle again: its first
    # token and the chunk compiles queued behind it (which its TTFT does not wait for, but the
    # next request would, under traffic)
    wall_seconds: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> list[float]:
        return [t for _, t in self.timed]

    def queue_growth(self) -> float | None:
        """p50 TTFT of the last third of arrivals over that of the first third.

        A server within its capacity holds its queue steady (about 1x, give or take noise); past
        it the queue, and so the TTFT, grows for as long as arrivals go on.
        """
        if len(self.timed) < 9:
            return None
        ttfts = [t for _, t in sorted(self.timed)]
        third = len(ttfts) // 3
        return percentile(ttfts[-third:], 0.5) / percentile(ttfts[:third], 0.5)


def arrivals_for(load: str, n: int, capacity: float | None, seed: int = 1) -> list[float] | None:
    """Arrival offsets in seconds: None for seq, zeros for offline, Poisson times for a rate."""
    if load == "seq":
        return None
    if load == "offline":
        return [0.0] * n
    return poisson_arrivals(rate_of(load, capacity), n, seed)


def rate_of(rate: str, capacity: float | None) -> float:
    """Requests/s of "12.5" (as given) or "0.9x" (that share of no-cache's capacity)."""
    if rate.endswith("x"):
        if capacity is None:
            raise ValueError(f"rate {rate!r} is relative to no-cache's capacity, which is not known yet")
        return float(rate[:-1]) * capacity
    return float(rate)


def poisson_arrivals(rate: float, n: int, seed: int = 1) -> list[float]:
    """n Poisson arrival offsets at `rate` requests/s (the same draws scaled, for any rate)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_load(engine: LLMEngine, corpus: Corpus, mode: str, stream: list[Request],
             arrivals: list[float] | None, params: SamplingParams,
             trace: StepTrace | None = None) -> LoadResult:  # fmt: skip
    """Serve the stream; TTFT from each request's arrival time to the step that gave its first token.

    The load ends when its requests have finished; chunk compiles still queued behind them run
    after that, untimed, so that each load's counters hold all the work its requests caused.
    """
    out_tokens = 0
    timed: list[tuple[float, float]] = []
    full_batches = "+full-batches" in mode
    start = time.monotonic()
    if arrivals is None:  # seq: one at a time
        submitted: list[float] = []
        walls: list[float] = []
        for req in stream:
            t0 = time.monotonic()
            rid = submit(engine, corpus, mode, req, params)
            submitted.append(time.monotonic() - t0)
            first = None
            while first is None or engine.has_unfinished_requests():
                began = time.monotonic() - start
                updates = engine.step()
                if trace is not None:
                    ran = max((len(u.new_token_ids) for u in updates), default=0)
                    trace.steps.append((began, time.monotonic() - start, trace.last_batch, ran))
                for u in updates:
                    out_tokens += len(u.new_token_ids)
                    if u.request_id == rid and first is None and u.new_token_ids:
                        first = time.monotonic()
            timed.append((t0 - start, first - t0))
            walls.append(time.monotonic() - t0)
        return LoadResult(timed, out_tokens, time.monotonic() - start, len(stream), submitted, walls)
    arrival_of: dict[int, float] = {}
    pending = finished = 0

    def arrived() -> bool:  # what a server's request queue tells the engine between steps
        return pending < len(stream) and arrivals[pending] <= time.monotonic() - start

    while finished < len(stream):
        now = time.monotonic() - start
        # Queue everything that has arrived by now (arrival times are sorted).
        while pending < len(stream) and arrivals[pending] <= now:
            arrival_of[submit(engine, corpus, mode, stream[pending], params)] = arrivals[pending]
            pending += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        began = time.monotonic() - start
        updates = engine.step(None if full_batches else arrived)
        done_at = time.monotonic() - start
        if trace is not None:
            ran = max((len(u.new_token_ids) for u in updates), default=0)
            trace.steps.append((began, done_at, trace.last_batch, ran))
        for u in updates:
            out_tokens += len(u.new_token_ids)
            if u.request_id in arrival_of and u.new_token_ids:
                arrival = arrival_of.pop(u.request_id)
                timed.append((arrival, done_at - arrival))
            finished += u.finished
    seconds = time.monotonic() - start
    while engine.has_unfinished_requests():  # compiles queued behind the last requests
        engine.step()
    return LoadResult(timed, out_tokens, seconds, len(stream))


class StepTrace:
    """--trace-slow: every engine step of a load (start, end, what was scheduled) and each request's TTFT."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[float, float, str, int]] = []
        self.last_batch = ""
        schedule = engine.scheduler.schedule

        def traced():  # noqa: ANN202
            batch = schedule()
            decodes = sum(e.is_decode for e in batch.entries)
            prefill = sum(e.num_new_tokens for e in batch.entries if not e.is_decode)
            self.last_batch = (f"{decodes} decodes + {len(batch.entries) - decodes} prefill runs "
                               f"({prefill} tokens, {len(batch.kv_copies)} block copies), {batch.num_steps} steps")
            return batch

        engine.scheduler.schedule = traced
        # Python's garbage collector: a full collection over the engine's bookkeeping (tens of
        # thousands of cached-block entries) stalls the loop between steps, unseen by the steps.
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._gc_start = 0.0

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_start = time.perf_counter()
            else:
                self.gc_pauses.append((info["generation"], time.perf_counter() - self._gc_start))

        self.on_gc = on_gc
        gc.callbacks.append(on_gc)
        # Kernels Triton compiles (or loads from its disk cache) during the load: each one stalls a step.
        self._recording = recording_triton_compiles()
        self.compiles = self._recording.__enter__()

    def report(self, timed: list[tuple[float, float]], worst: int = 3) -> None:
        """Print the load's compiles, GC pauses and the steps of its `worst` slowest requests (of LoadResult.timed)."""
        self._recording.__exit__(None, None, None)
        print(f"    Triton kernels compiled during the load: {len(self.compiles)} {sorted(set(self.compiles))}")
        gc.callbacks.remove(self.on_gc)
        for gen in (0, 1, 2):
            pauses = [t for g, t in self.gc_pauses if g == gen]
            if pauses:
                print(f"    GC generation {gen}: {len(pauses)} collections, {sum(pauses) * 1e3:.1f} ms in all, "
                      f"longest {max(pauses) * 1e3:.1f} ms")  # fmt: skip
        for arrival, ttft in sorted(timed, key=lambda r: -r[1])[:worst]:
            window = [s for s in self.steps if s[1] > arrival and s[0] < arrival + ttft]
            busy = sum(min(e, arrival + ttft) - max(b, arrival) for b, e, _, _ in window)
            print(f"    slow request: arrived {arrival * 1e3:.0f} ms, TTFT {ttft * 1e3:.0f} ms, "
                  f"{len(window)} steps in between, stepping {busy * 1e3:.0f} ms of it:")  # fmt: skip
            for began, ended, what, ran in sorted(window, key=lambda s: s[0] - s[1])[:4]:
                print(f"      {(ended - began) * 1e3:.1f} ms at {began * 1e3:.0f}: {what}, ran {ran}")


def history_of(warm_stream: list[Request], streams: dict[str, list[Request]], load: str) -> list[Request]:
    """What ran on a mode's engine before `load`: the warm-up (its last KERNEL_WARMUP twice), then earlier loads."""
    out = [*warm_stream, *kernel_warmup(warm_stream)]
    for name, stream in streams.items():
        if name == load:
            return out
        out += stream
    raise KeyError(load)


def kernel_warmup(warm_stream: list[Request]) -> list[Request]:
    """The warm-up requests run a second time with full answers (the decode kernels of every batch size)."""
    return warm_stream[-min(len(warm_stream), KERNEL_WARMUP) :]


def load_streams(corpus: Corpus, loads: list[str], n: int, n_seq: int, slo_probes: int = 0,
                 n_slo: int | None = None) -> dict[str, list[Request]]:  # fmt: skip
    """Each load's requests, drawn in load order: n_seq for seq, n for the others; "slo" is slo_probes streams.

    The SLO sweep's probes are loads "slo1", "slo2", ... of n_slo requests each (default n; each
    probe its own requests, so that none re-sends what an earlier one cached), drawn in place of "slo".
    """
    sizes: dict[str, int] = {}
    for load in loads:
        if load == "slo":
            sizes.update({f"slo{i + 1}": n_slo or n for i in range(slo_probes)})
        else:
            sizes[load] = n_seq if load == "seq" else n
    return {name: corpus.requests(size) for name, size in sizes.items()}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def copy_back_vs_recompute(engine: LLMEngine, corpus: Corpus, repeats: int = 5) -> tuple[float, float, int]:
    """Milliseconds to copy one chunk's blocks back from host memory, and to recompute its tokens.

    Copy back: the host tier's own copies (HostKVBuffer.swap_in) of as many blocks as a chunk
    fills, into free GPU blocks, timed with a device sync. Recompute: a prefill of the chunk's
    tokens after the cached head (a first-token-only request), the same tokens as the copy.
    """
    runner, bm = engine.model_runner, engine.block_manager
    blocks = corpus.sizes.chunk_tokens // bm.block_size
    if runner.host_kv is None or runner.host_kv.blocks.shape[0] < blocks:
        return float("nan"), float("nan"), blocks
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    free = bm.scratch_blocks(blocks)  # writing them disturbs no cached KV
    if len(free) < blocks:
        return float("nan"), float("nan"), blocks
    copy_ms = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for slot, block in enumerate(free):
            runner.host_kv.swap_in(slot, block)
        sync()
        copy_ms.append((time.perf_counter() - t) * 1e3)
    rng = random.Random(7)
    compute_ms = []
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(repeats):
        ids = corpus.head + [rng.randrange(10, 1000) for _ in range(corpus.sizes.chunk_tokens)]
        sync()
        t = time.perf_counter()
        engine.add_request(ids, params, "docs", incremental_text=False)
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        compute_ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(copy_ms), statistics.median(compute_ms), blocks


def copy_out_stall(engine: LLMEngine, corpus: Corpus, repeats: int = 5) -> tuple[float, float, float]:
    """Milliseconds the compute stream waits to copy one chunk's blocks out: staged, and directly.

    Staged is the host tier's path (HostKVBuffer.swap_out, then before_step's gather into GPU
    staging; the copy to host runs on its own stream): the compute stream waits for the gather
    alone. Directly is the peer, what the tier did before: each block copied to its host slot on
    the compute stream, so the step after an eviction waited for PCIe. Also: when the staged
    copies have landed on the host. CUDA only (NaN elsewhere).
    """
    runner, bm = engine.model_runner, engine.block_manager
    host = runner.host_kv
    blocks = corpus.sizes.chunk_tokens // bm.block_size
    if runner.device.type != "cuda" or host is None or host.blocks.shape[0] < blocks:
        return float("nan"), float("nan"), float("nan")
    free = bm.scratch_blocks(blocks)
    compute = torch.cuda.current_stream()
    staged, landed, direct = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for slot, block in enumerate(free):
            host.swap_out(block, slot)
        host.before_step()
        compute.synchronize()
        staged.append((time.perf_counter() - t) * 1e3)
        host.synchronize()
        landed.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for slot, block in enumerate(free):
            host.blocks[slot].copy_(runner.kv_cache[:, :, block], non_blocking=True)
        compute.synchronize()
        direct.append((time.perf_counter() - t) * 1e3)
    return statistics.median(staged), statistics.median(direct), statistics.median(landed)


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


def engine_config(mode: str, device: str, dry: bool, gpu_blocks: int | None, host_blocks: int) -> EngineConfig:
    base = base_mode(mode)
    return EngineConfig(
        device=device, dtype="bfloat16" if device == "cuda" else "float32",
        enable_prefix_caching=base != "no-cache", kv_reuse="chunks" if base.startswith("chunks") else "exact",
        chunk_miss="in_place" if base.startswith("chunks-inplace") else "wait",
        host_kv_blocks=host_blocks if "+host" in mode else 0,
        host_kv_admit_uses=0 if "+host-all" in mode else EngineConfig.host_kv_admit_uses,  # +host-all: the old tier
        max_model_len=512 if dry else 8192, num_kv_blocks=gpu_blocks or (2048 if dry else None),
    )  # fmt: skip


def counters(before, after) -> dict:  # noqa: ANN001 (MetricsSnapshot)
    def d(name: str) -> int:
        return getattr(after, name) - getattr(before, name)

    return {
        "prefix_hit": d("prefix_cache_hit_tokens") / max(1, d("prefix_cache_queried_tokens")),
        "chunk_hits": d("chunk_cache_hits"),
        "chunk_misses": d("chunk_cache_misses"),
        "host_hits": d("host_kv_hits"),
        "copy_hidden": d("host_kv_copy_back_hidden"),
        "copy_waited": d("host_kv_copy_back_waited"),
        "copied_out": d("host_kv_swapped_out"),
        "computed": d("prompt_computed_tokens"),
        "stopped_early": d("num_batches_stopped_early"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny random model and sizes: checks the script runs")
    ap.add_argument("--modes", default="no-cache,exact-rank,exact-aware,chunks,chunks-inplace",
                    help=f"comma-separated, in run order; valid: {','.join(MODES)}")  # fmt: skip
    ap.add_argument("--rates", default="0.5x,0.9x",
                    help="Poisson rates: requests/s, or NNx = that share of no-cache's offline capacity")  # fmt: skip
    ap.add_argument("--loads", default="seq,offline,slo", help="which of seq, offline, rates, slo to run, in order")
    ap.add_argument("--slo-ms", type=float, default=1000.0, help="slo: the TTFT objective in ms (default 1000)")
    ap.add_argument("--slo-quantile", type=float, default=0.99, help="slo: the TTFT quantile held to it (0.99)")
    ap.add_argument("--slo-growth", type=float, default=1.25,
                    help="slo: the most queue growth a probe may show and meet it (1.25)")  # fmt: skip
    ap.add_argument("--slo-range", default="0.5x,3x",
                    help="slo: the rates bisected between, req/s or NNx of no-cache's capacity (0.5x,3x)")  # fmt: skip
    ap.add_argument("--slo-probes", type=int, default=5, help="slo: probes (loads) per mode (5: within 6%% of 0.5x-3x)")
    ap.add_argument("--slo-requests", type=int, default=None, help="slo: requests per probe (default --requests)")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per load (default 150; dry 12)")
    ap.add_argument("--seq-requests", type=int, default=None, help="requests of the seq load (default 60; dry 6)")
    ap.add_argument("--warmup", type=int, default=None, help="prefill-only requests that warm each mode (default 400)")
    ap.add_argument("--capacity", type=float, default=None, help="no-cache's requests/s, when no-cache does not run")
    ap.add_argument("--gpu-kv-blocks", type=int, default=None, help="GPU KV pool size in blocks (default: measured)")
    ap.add_argument("--host-kv-blocks", type=int, default=16384, help="host tier size of the +host modes, in blocks")
    ap.add_argument("--copy-back", action="store_true", help="also time a chunk's copy back against its recompute")
    ap.add_argument("--trace-slow", action="store_true",
                    help="after each load: Triton kernels compiled in it, the slowest requests, their longest steps")
    ap.add_argument("--folder", type=Path, default=None, help="reuse (or write) the random model folder here")
    args = ap.parse_args()
    dry = args.dry_run
    sizes = DRY if dry else ISSUE
    n = args.requests or (12 if dry else 150)
    n_seq = args.seq_requests or (6 if dry else 60)
    warm = args.warmup if args.warmup is not None else (12 if dry else 400)
    device = "cpu" if dry else "cuda"
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    loads: list[str] = []
    for part in args.loads.split(","):
        loads += [r for r in args.rates.split(",") if r] if part == "rates" else [part]
    slo_range = [r for r in args.slo_range.split(",") if r]
    if "slo" in loads and (len(slo_range) != 2 or args.slo_probes < 1):
        ap.error("--slo-range takes two rates, low,high, and --slo-probes at least 1")
    try:
        slo = Slo(args.slo_ms, args.slo_quantile, args.slo_growth)
    except ValueError as exc:
        ap.error(str(exc))
    slo_relative = "slo" in loads and any(r.endswith("x") for r in slo_range)
    relative = [load for load in loads if load.endswith("x") or (load == "slo" and slo_relative)]
    first_relative = loads.index(relative[0]) if relative else len(loads)
    measured = modes[0] == "no-cache" and "offline" in loads[:first_relative]
    if relative and args.capacity is None and not measured:
        ap.error("relative rates (NNx) need no-cache as the first mode and its offline load before them, "
                 "or --capacity")  # fmt: skip
    folder = make_folder(dry, args.folder)
    vocab = 1024 if dry else 128256
    corpus = Corpus(sizes, vocab)
    warm_stream = corpus.requests(warm)
    streams = load_streams(corpus, loads, n, n_seq, args.slo_probes, args.slo_requests)
    params = SamplingParams(max_tokens=sizes.answer_tokens, ignore_eos=True)
    first_token = SamplingParams(max_tokens=1, ignore_eos=True)
    hw = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# rag_kv_reuse: {hw}, {datetime.date.today()}, {sizes.num_chunks} chunks x {sizes.chunk_tokens} tokens, "
          f"{sizes.sources} sources, {sizes.question_tokens}-token questions, {sizes.answer_tokens}-token answers; "
          f"{warm} prefill-only warm-up requests per mode, then {n_seq} seq and {n} per other load"
          f"{f'; GPU pool {args.gpu_kv_blocks} blocks' if args.gpu_kv_blocks else ''}", flush=True)  # fmt: skip
    capacity = args.capacity
    prefill_share: float | None = None
    results: dict[tuple[str, str], tuple[LoadResult, dict]] = {}
    sweeps: dict[str, list[Probe]] = {}
    copy_back: list[tuple[str, float, float, int, float, float, float]] = []
    for mode in modes:
        set_kv_copy_kernel("+torch-copy" not in mode)
        engine = LLMEngine(folder, engine_config(mode, device, dry, args.gpu_kv_blocks, args.host_kv_blocks))
        if "+host-inline" in mode:
            engine.model_runner.host_kv.overlap_copy_back = False
        # As `rag serve` does once it is up: start-up objects (modules, model, the corpus) stay
        # out of full GCs, which otherwise pause a step for ~0.3 s at random (--trace-slow).
        freeze_startup_heap()
        t = time.monotonic()
        run_load(engine, corpus, mode, warm_stream, [0.0] * len(warm_stream), first_token)
        # Decoding batches of every size once (JIT-compiled kernels, CUDA graphs): otherwise the
        # first mode's first decoding load pays for them and its peers look faster than they are.
        kernels = kernel_warmup(warm_stream)
        run_load(engine, corpus, mode, kernels, [0.0] * len(kernels), params)
        print(f"{mode}: warm-up {time.monotonic() - t:.1f} s, {engine.block_manager.num_blocks} GPU blocks",
              flush=True)  # fmt: skip
        for load in loads:
            if load == "slo":
                low, high = (rate_of(r, capacity) for r in slo_range)

                def probe(i: int, rate: float, mode: str = mode, engine: LLMEngine = engine) -> Probe:
                    name = f"slo{i + 1}"
                    before = engine.get_metrics()
                    result = run_load(engine, corpus, mode, streams[name], poisson_arrivals(rate, len(streams[name])),
                                      params)  # fmt: skip
                    results[(mode, name)] = (result, counters(before, engine.get_metrics()))
                    q_ms, growth = percentile(result.ttft, slo.quantile) * 1e3, result.queue_growth()
                    out = Probe(rate, q_ms, growth, slo.miss(q_ms, growth))
                    print(f"  slo probe {i + 1}: {rate:.2f}/s, p{slo.quantile * 100:g} TTFT {q_ms:.0f} ms, queue "
                          f"growth {'-' if growth is None else f'{growth:.2f}x'}: {out.missed or 'met'}", flush=True)
                    return out

                sweeps[mode] = sweep(probe, low, high, args.slo_probes)
                del probe  # its default argument holds the engine, which must go before the next is built
                continue
            arrivals = arrivals_for(load, len(streams[load]), capacity)
            before = engine.get_metrics()
            trace = StepTrace(engine) if args.trace_slow else None
            result = run_load(engine, corpus, mode, streams[load], arrivals, first_token if load == "seq" else params,
                              trace)  # fmt: skip
            results[(mode, load)] = (result, counters(before, engine.get_metrics()))
            if mode == "no-cache" and load == "offline":
                if capacity is None:
                    capacity = result.requests / result.seconds
                # The same burst again, prefill only: no-cache keeps nothing, so this is the
                # prefill share of its offline time, which bounds what any cache can gain there.
                prefill_only = run_load(engine, corpus, mode, streams[load], arrivals, first_token)
                prefill_share = min(1.0, prefill_only.seconds / result.seconds)
                print(f"  no-cache offline prefill only: {prefill_only.seconds:.1f} s, {prefill_share:.0%} of the load",
                      flush=True)  # fmt: skip
            row = table_row(results, mode, load, corpus, warm_stream, streams, capacity)
            print(f"  {result.seconds:.1f} s {row}", flush=True)
            if result.submit_seconds:
                print(f"  {mode} seq: submit() p50 {percentile(result.submit_seconds, 0.5) * 1e3:.2f} ms of the TTFT "
                      "(host work before the first step); wall (submit until the engine is idle: compiles queued "
                      f"behind included) p50 {percentile(result.wall_seconds, 0.5) * 1e3:.1f} ms, "
                      f"p99 {percentile(result.wall_seconds, 0.99) * 1e3:.1f} ms", flush=True)  # fmt: skip
            if trace is not None:
                trace.report(result.timed)
                del engine.scheduler.schedule  # back to the class's method
        if args.copy_back and "+host" in mode:
            copy_back.append((mode, *copy_back_vs_recompute(engine, corpus), *copy_out_stall(engine, corpus)))
        gc.unfreeze()  # this engine must be collectable before the next one is built
        trace = None  # a StepTrace holds the engine too
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    table_loads = [load for load in loads if load != "slo"]
    print_table(results, modes, table_loads, corpus, warm_stream, streams, capacity)
    if sweeps:
        print_slo(sweeps, slo, capacity)
    for mode, copy_ms, compute_ms, blocks, staged_ms, direct_ms, landed_ms in copy_back:
        print(f"\ncopy back vs recompute ({mode}): one chunk's {blocks} blocks from the host tier {copy_ms:.2f} ms, "
              f"its {sizes.chunk_tokens} tokens recomputed after the head {compute_ms:.2f} ms "
              f"({compute_ms / copy_ms:.1f}x)")  # fmt: skip
        print(f"copy out ({mode}): the compute stream waits {staged_ms:.2f} ms for one chunk's {blocks} blocks "
              f"(gathered into GPU staging; on the host after {landed_ms:.2f} ms) against {direct_ms:.2f} ms "
              f"copied directly on it, as before ({direct_ms / staged_ms:.1f}x)")  # fmt: skip
    print_goals(results, modes, table_loads, corpus, warm_stream, streams, prefill_share, sweeps)


TABLE_HEAD = (
    "| mode | load | p50 TTFT ms | p99 TTFT ms | p50 vs no-cache | output tok/s | vs no-cache | prefix hit | "
    "chunk hits/misses | host hits | host copies out | prompt tokens computed | least computable | "
    "of ideal | batches stopped early | queue growth | ideal speed-up |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def bound_of(corpus: Corpus, warm_stream: list[Request], streams: dict[str, list[Request]], load: str, mode: str):  # noqa: ANN201
    """The load's kv_reuse_bound.Bound for the mode, after everything that ran before it on the mode's engine."""
    return least_computed(corpus.sizes, history_of(warm_stream, streams, load), streams[load], mode)


def table_row(results, mode, load, corpus, warm_stream, streams, capacity) -> str:  # noqa: ANN001
    """One markdown row; ratios against no-cache's row of the same load when it ran.

    "least computable" is the bound's tokens (no run computes fewer), "of ideal" the measured token
    speed-up against the ideal one (least computable / computed: at most 100%).
    """
    base = results.get(("no-cache", load))
    r, c = results[(mode, load)]
    p50, p99 = percentile(r.ttft, 0.5) * 1e3, percentile(r.ttft, 0.99) * 1e3
    tput = r.output_tokens / r.seconds
    rel_ttft = f"{percentile(base[0].ttft, 0.5) * 1e3 / p50:.2f}x" if base else "-"
    rel_tput = f"{tput / (base[0].output_tokens / base[0].seconds):.2f}x" if base and load != "seq" else "-"
    bound = bound_of(corpus, warm_stream, streams, load, mode)
    name = f"{load} ({float(load[:-1]) * capacity:.2f}/s)" if load.endswith("x") and capacity else load
    # A queue only forms under arrivals: seq has none, and an offline burst arrives all at once.
    growth = r.queue_growth() if load not in ("seq", "offline") else None
    return (
        f"| {mode} | {name} | {p50:.1f} | {p99:.1f} | {rel_ttft} | {tput:.0f} | {rel_tput} | "
        f"{c['prefix_hit']:.2f} | {c['chunk_hits']}/{c['chunk_misses']} | {host_hits(mode, c)} | "
        f"{c['copied_out'] if '+host' in mode else '-'} | {c['computed']} | {bound.least_computed} | "
        f"{bound.least_computed / max(1, c['computed']):.0%} | {c['stopped_early']} | "
        f"{'-' if growth is None else f'{growth:.2f}x'} | {bound.ideal_speedup:.2f}x |"
    )


def host_hits(mode: str, c: dict) -> str:
    """Host-tier hits, with how many copies back were hidden / waited for when they overlap."""
    if "+host" not in mode or "+host-inline" in mode:
        return str(c["host_hits"])
    return f"{c['host_hits']} ({c['copy_hidden']}/{c['copy_waited']})"


def print_table(results, modes, loads, corpus, warm_stream, streams, capacity) -> None:  # noqa: ANN001
    print(f"\n{TABLE_HEAD}")
    for load in loads:
        for mode in modes:
            print(table_row(results, mode, load, corpus, warm_stream, streams, capacity))
    if capacity:
        print(f"\nno-cache capacity (offline requests/s): {capacity:.2f}")


def print_slo(sweeps: dict[str, list[Probe]], slo: Slo, capacity: float | None) -> None:
    """Per mode: the fastest rate that met the SLO, the slowest that missed it, and the probes."""
    base = crossing(sweeps["no-cache"])[0] if "no-cache" in sweeps else None
    print(f"\nSLO: {slo.name}; rates bisected, each probe a Poisson load of its own requests on the idle engine")
    print("| mode | meets the SLO up to (req/s) | vs no-cache | x no-cache's offline capacity | TTFT quantile there "
          "ms | queue growth there | slowest rate missed (req/s) | why | probes (req/s: met / missed) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, probes in sweeps.items():
        met, missed = crossing(probes)
        up_to = f"{met.rate:.2f}" if met else f"< {min(p.rate for p in probes):.2f}"
        if missed is None:
            up_to = f">= {met.rate:.2f}"
        rel = f"{met.rate / base.rate:.2f}x" if met and base else "-"
        cap = f"{met.rate / capacity:.2f}x" if met and capacity else "-"
        growth = "-" if met is None or met.growth is None else f"{met.growth:.2f}x"
        trail = ", ".join(f"{p.rate:.2f} {'met' if p.met else 'missed'}" for p in probes)
        print(f"| {mode} | {up_to} | {rel} | {cap} | {f'{met.quantile_ms:.0f}' if met else '-'} | {growth} | "
              f"{f'{missed.rate:.2f}' if missed else '-'} | {missed.missed if missed else '-'} | {trail} |")


def throughput_ideal(prompt_ideal: float, prefill_share: float) -> float:
    """The offline throughput gain when prefill work falls by `prompt_ideal` and decode stays.

    Args:
        prompt_ideal: prompt tokens / tokens still computed (ideal_speedup).
        prefill_share: the share of no-cache's offline time that is prefill (0..1).
    """
    return 1.0 / (prefill_share / prompt_ideal + (1.0 - prefill_share))


def print_goals(results, modes, loads, corpus, warm_stream, streams,  # noqa: ANN001
                prefill_share: float | None = None, sweeps: dict[str, list[Probe]] | None = None) -> None:
    """The issue's goals against this run (only those whose rows ran).

    Each ideal is the bound's (kv_reuse_bound.py: no run computes fewer prompt tokens). Offline
    throughput is held against the throughput ideal when no-cache's prefill share was measured
    (decode work is the same in every mode, so the prompt-token ideal, printed beside it, is out
    of any mode's reach), else against the prompt-token ideal. Sequential TTFT is also given as
    wall time (submit until the engine is idle), which counts the compiles a request queues behind
    itself. Under load: the fastest rate that meets the TTFT SLO (print_slo), against no-cache's.
    """

    def p50(mode: str, load: str) -> float:
        return percentile(results[(mode, load)][0].ttft, 0.5)

    def tput(mode: str, load: str) -> float:
        r = results[(mode, load)][0]
        return r.output_tokens / r.seconds

    print("\ngoals:")
    for mode in modes:
        for load in ("seq", "offline"):
            if (mode, load) not in results:
                continue
            bound = bound_of(corpus, warm_stream, streams, load, mode)
            computed = results[(mode, load)][1]["computed"]
            # Below the bound would be a fault: of the bound (a rule it misses) or of the counters.
            holds = ">=" if computed >= bound.least_computed else "< (BELOW THE BOUND)"
            print(f"  {mode}: {load} prompt tokens computed {computed} {holds} least computable {bound.least_computed}"
                  f": {bound.least_computed / max(1, computed):.0%} of the ideal {bound.ideal_speedup:.2f}x")
            if mode == "no-cache" or ("no-cache", load) not in results:
                continue
            ideal = bound.ideal_speedup
            if load == "seq":
                got = p50("no-cache", load) / p50(mode, load)
                print(f"  {mode}: sequential TTFT {got:.2f}x of ideal {ideal:.2f}x = {got / ideal:.0%} (goal >= 80%)")
                walls = results[("no-cache", load)][0].wall_seconds, results[(mode, load)][0].wall_seconds
                wall = percentile(walls[0], 0.5) / percentile(walls[1], 0.5)
                print(f"  {mode}: sequential wall time (submit until idle, compiles behind included) {wall:.2f}x of "
                      f"ideal {ideal:.2f}x = {wall / ideal:.0%}")  # fmt: skip
                continue
            got = tput(mode, load) / tput("no-cache", load)
            if prefill_share is not None:
                bound_x = throughput_ideal(ideal, prefill_share)
                print(f"  {mode}: offline throughput {got:.2f}x of its ideal {bound_x:.2f}x (prompt-token ideal "
                      f"{ideal:.2f}x, prefill {prefill_share:.0%} of no-cache's offline time) = {got / bound_x:.0%} "
                      "(goal >= 80%)")  # fmt: skip
                continue
            print(f"  {mode}: offline throughput {got:.2f}x of ideal {ideal:.2f}x = {got / ideal:.0%} (goal >= 80%)")
    if sweeps and "no-cache" in sweeps:
        base = crossing(sweeps["no-cache"])[0]
        for mode, probes in sweeps.items():
            met = crossing(probes)[0]
            if mode != "no-cache" and met and base:
                print(f"  {mode}: meets the TTFT SLO up to {met.rate:.2f} req/s, {met.rate / base.rate:.2f}x "
                      f"no-cache's {base.rate:.2f} req/s")  # fmt: skip
    rates = [load for load in loads if load not in ("seq", "offline")]
    for chunk_mode in [m for m in BASE_MODES if m.startswith("chunks")]:
        if ("exact-rank", rates[-1] if rates else "seq") in results and chunk_mode in modes:
            for load in [*(["seq"] if "seq" in loads else []), *rates]:
                print(f"  {chunk_mode}: p50 TTFT at {load} {p50('exact-rank', load) / p50(chunk_mode, load):.2f}x "
                      "lower than exact-rank (goal >= 2x)")  # fmt: skip


if __name__ == "__main__":
    main()
