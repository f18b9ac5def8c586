"""Where a step's time goes on the GPU: decode graph replays, fused kernels on/off, an eager short prefill.

Called by bench/engine_llama8b.py (`--only profile`) with its loaded engine; every figure is GPU
time from CUDA events (or host wall time where it says so), beside the bandwidth floor of the
same run. Sequences are allocated from the engine's own block pool and released afterwards.

The floor of a step is honest (bench/roofline.py): the bytes that step reads (the weights it
streams, the input embedding excluded unless the head is tied to it, plus the KV of its batch
at its context) over the read bandwidth measured by the caller, so every batch has its own.
"""

from __future__ import annotations

import random
import time

import torch
from roofline import DecodeFloor, decode_bytes, percent_of_floor

from generation import LLM, SamplingParams
from generation.engine.decode_graphs import DecodeGraphs
from generation.engine.decode_inputs import DecodeInputs
from generation.engine.scheduler import ScheduledBatch, ScheduledEntry
from generation.engine.sequence import Sequence
from generation.layers.kernel_choice import set_fused_kernels


def gpu_ms(fn, reps: int = 20) -> float:
    """Median GPU milliseconds of fn over reps runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_times(run, reps: int) -> dict[str, list[float]]:
    """GPU microseconds of every kernel `run` launches over `reps` runs, by kernel name (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name, []).append(event.time_range.elapsed_us())
    return times


def kernel_breakdown(step, step_ms: float, floor_ms: float, reps: int = 10) -> None:
    """Print per-kernel GPU time of `step` (a graph replay) from the profiler's kernel records."""
    step()
    per_kind = kernel_times(step, reps)
    busy = sum(sum(t) for t in per_kind.values()) / reps / 1e3
    launches = sum(len(t) for t in per_kind.values()) / reps
    print(
        f"  batch 1 kernels: {launches:.0f} per step, busy {busy:.3f} ms of the {step_ms:.3f} ms step "
        f"(gaps {step_ms - busy:.3f} ms; floor {floor_ms:.2f} ms)"
    )
    for name, times in sorted(per_kind.items(), key=lambda kv: -sum(kv[1]))[:14]:
        print(f"    {sum(times) / reps:8.1f} us  x{len(times) / reps:<4.0f} {name[:90]}")


# Kernel-name patterns of a prefill profile, first match wins: which part of the step a kernel is.
PREFILL_PARTS = (
    ("norm + fp8 quantize (fused)", r"norm_quant"),
    ("SiLU-and-mul + fp8 quantize (fused)", r"silu_and_mul_quant"),
    ("fp8 activation quantize", r"quantize"),
    ("attention", r"attn|attention|paged|flash|fmha|sdpa"),
    ("matmul", r"gemm|matmul|cutlass|sm90|sm80|nvjet|cublas|_mm_|skinny|scaled_mm"),
    ("norm", r"rms|norm"),
    ("rotary + KV store", r"rotary|rope|kv_store|store_kv"),
    ("SiLU-and-mul", r"silu"),
)


def prefill_shares(run, reps: int = 1) -> list[tuple[str, float, int]]:
    """GPU time of `run` (a prefill workload) by part of the step: [(part, ms per run, kernels per run)].

    Kernels are classified by name (PREFILL_PARTS); what matches no pattern is "other" (copies,
    sampling, index arithmetic). Busy GPU time only: host gaps are not in the shares.
    """
    import re

    parts: dict[str, list[float]] = {}
    for name, times in kernel_times(run, reps).items():
        part = next((p for p, pattern in PREFILL_PARTS if re.search(pattern, name.lower())), "other")
        parts.setdefault(part, []).extend(times)
    rows = [(part, sum(t) / reps / 1e3, round(len(t) / reps)) for part, t in parts.items()]
    return sorted(rows, key=lambda r: -r[1])


def _sequences(llm: LLM, n: int, context: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    bm = llm.engine.block_manager
    seqs = []
    for _ in range(n):
        seq = Sequence([rng.randrange(10, 100000) for _ in range(context)], max_tokens=1)
        bm.allocate(seq)
        seqs.append(seq)
    return seqs


STEP_CASES = ((1, 640), (16, 843), (64, 843), (256, 843))  # (batch, context) of the decode steps timed


def step_floor(llm: LLM, batch: int, context: int, read_bw: float) -> DecodeFloor:
    """The honest floor of one decode step of `batch` sequences at `context` tokens each."""
    kv_bytes = llm.engine.model_runner.kv_cache.element_size()
    return DecodeFloor(decode_bytes(llm.model, context, batch, kv_bytes).total, read_bw)


def profile(llm: LLM, read_bw: float) -> dict[str, tuple[str, float]]:
    """Print where decode steps' GPU time goes; returns {measure: (text, number)} for the caller's table."""
    runner = llm.engine.model_runner
    bm = llm.engine.block_manager
    graphs = runner.decode_graphs
    assert graphs is not None, "the profile needs CUDA graphs"
    figures: dict[str, tuple[str, float]] = {}
    weights = "fp8 weights" if any(p.dtype == torch.float8_e4m3fn for p in llm.model.parameters()) else "weights"
    print(f"profile: GPU time of one decode step (CUDA graph replay: forward + LM head), {llm.dtype} / {weights}, "
          f"KV {runner.kv_cache.dtype}")  # fmt: skip
    with torch.inference_mode():
        for batch, context in STEP_CASES:
            floor = step_floor(llm, batch, context, read_bw)
            if batch * -(-context // runner.block_size) > bm.num_free_blocks:
                print(f"  batch {batch:<4} context {context}: skipped, {bm.num_free_blocks} KV blocks free")
                continue
            seqs = _sequences(llm, batch, context, seed=batch)
            entries = [ScheduledEntry(s, 1, context - 1, samples=True) for s in seqs]
            runner.decode_inputs.write(entries, graphs.bucket(batch))
            ms = gpu_ms(lambda b=batch: graphs.replay(b))
            pct = percent_of_floor(floor.ms, ms)
            print(f"  batch {batch:<4} context {context}: {ms:.3f} ms per step, {batch / ms * 1e3:,.0f} tok/s "
                  f"({pct:.0f}% of the {floor.describe()} floor)")  # fmt: skip
            figures[f"decode step (graph replay), batch {batch}, context {context}"] = (
                f"{ms:.3f} ms ({pct:.0f}% of the {floor.ms:.3f} ms floor)",
                ms,
            )
            for s in seqs:
                bm.deallocate(s)
        floor_ms = step_floor(llm, 1, 640, read_bw).ms

        # Kernel by kernel, the batch-1 step: what each kind costs per step, and how much of the
        # step no kernel runs (launch gaps between the graph's nodes).
        seqs = _sequences(llm, 1, 640, seed=5)
        runner.decode_inputs.write([ScheduledEntry(seqs[0], 1, 639, samples=True)], graphs.bucket(1))
        step_ms = gpu_ms(lambda: graphs.replay(1))
        kernel_breakdown(lambda: graphs.replay(1), step_ms, floor_ms)
        for s in seqs:
            bm.deallocate(s)

        # The same batch-1 step with the fused kernels off: the torch ops they replace, cuBLAS matmuls.
        seqs = _sequences(llm, 1, 640, seed=7)
        entries = [ScheduledEntry(seqs[0], 1, 639, samples=True)]
        times = {}
        for fused in (False, True):
            set_fused_kernels(fused)
            inputs = DecodeInputs(1, runner.max_blocks_per_seq, runner.block_size, runner.device)
            one = DecodeGraphs(runner.model, runner.kv_caches, inputs)
            inputs.write(entries, 1)
            times[fused] = gpu_ms(lambda g=one: g.replay(1))
            del one
        set_fused_kernels(True)
        print(f"  batch 1, fused kernels off: {times[False]:.3f} ms, on: {times[True]:.3f} ms per step")
        figures["batch 1 step, fused kernels off"] = (f"{times[False]:.3f} ms", times[False])
        for s in seqs:
            bm.deallocate(s)

        # A whole 8-step batch at batch 1 as the engine runs it (replays, argmax, token copies,
        # input advances), against 8 bare replays: what the steps cost beyond the graph.
        seqs = _sequences(llm, 1, 648, seed=9)
        steps = runner.num_scheduler_steps
        batch = ScheduledBatch([ScheduledEntry(seqs[0], 1, 639, samples=True)], num_steps=steps)
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            list(runner.execute(batch, [SamplingParams()], [None]))
            walls.append((time.perf_counter() - t) * 1e3 / steps)
        logits = graphs.replay(1)
        tokens = logits.argmax(-1)
        parts = {
            "argmax": gpu_ms(lambda: logits.argmax(-1), reps=50),
            "advance": gpu_ms(lambda: runner.decode_inputs.advance(tokens), reps=50),
            "token copy": gpu_ms(lambda: runner._publish(0, tokens), reps=50),
        }
        print(
            f"  batch 1, a {steps}-step batch through ModelRunner.execute: {sorted(walls)[2]:.3f} ms per step (wall); "
            + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in parts.items())
        )
        for s in seqs:
            bm.deallocate(s)

        # The short prefill over a cached prefix (the prefix-cache TTFT case): graph and eager.
        seqs = _sequences(llm, 1, 4096, seed=8)
        seqs[0].num_computed_tokens = 4000
        batch = ScheduledBatch([ScheduledEntry(seqs[0], 96, 4000, samples=True)])
        prefill_graphs = runner.prefill_graphs
        for name, graph in (("graph", prefill_graphs), ("eager", None)):
            runner.prefill_graphs = graph
            gpu = gpu_ms(lambda: runner.step_logits(runner.prepare_inputs(batch)), reps=10)
            walls = []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.step_logits(runner.prepare_inputs(batch)).argmax(-1).tolist()
                walls.append((time.perf_counter() - t) * 1e3)
            print(
                f"  prefill of 96 new tokens over 4,000 cached ({name}): {gpu:.2f} ms GPU span, "
                f"{sorted(walls)[2]:.2f} ms host wall to the token"
            )
        runner.prefill_graphs = prefill_graphs
        for s in seqs:
            bm.deallocate(s)
    bm.reset_prefix_cache()
    return figures
