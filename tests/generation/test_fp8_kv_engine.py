"""The engine with an FP8 KV cache (kv_cache_dtype="fp8") on CPU: generation close to "auto", exact prefix
reuse reading the same bytes, chunk reuse with re-rotation, the host tier's byte-exact round trip."""

from __future__ import annotations

import random

import pytest
import torch

import generation.engine.model_runner as model_runner_module
from generation import LLM, SamplingParams
from generation.layers.kv_fp8 import FP8_KV_DTYPE

from .test_chunk_reuse import MIXED, REORDERED, first_logits
from .test_host_kv_tier import FILLERS, ONE, PROMPT_A, cached_kv, gpu_cached_tokens, prompt_logits

BS = 4


def make_llm(path, **engine_args) -> LLM:
    engine_args.setdefault("num_kv_blocks", 128)
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, **engine_args)


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(length)] for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("default")[0]


def test_an_fp8_engine_stores_e4m3_and_generates_close_to_auto(tiny):
    auto, fp8 = make_llm(tiny), make_llm(tiny, kv_cache_dtype="fp8")
    runner = fp8.engine.model_runner
    assert runner.kv_cache.dtype == FP8_KV_DTYPE and auto.engine.model_runner.kv_cache.dtype == torch.float32
    assert runner.kv_scales is not None and torch.equal(runner.kv_scales, torch.ones(2, 2))  # uncalibrated: 1.0
    assert auto.engine.model_runner.kv_scales is None
    prompts = random_prompts(8, 12)
    # First-token logits: an FP8-sized difference (the tiny random model's K/V reach ~6, where an e4m3
    # step is 0.25..0.5), and not none (the cache really is FP8).
    for i, prompt in enumerate(prompts[:4]):
        want, got = prompt_logits(auto.engine, prompt, f"p{i}"), prompt_logits(fp8.engine, prompt, f"p{i}")
        err = (got - want).abs().max().item()
        assert 1e-3 < err < 0.2 * want.abs().max().item(), err
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in auto.generate(prompts, params)]
    got = [o.token_ids for o in fp8.generate(prompts, params)]
    assert all(len(g) == 12 for g in got)
    assert [g[0] for g in got] == [w[0] for w in want]  # the first token of every prompt
    # Greedy runs then part where a near-tie flips; most tokens come before that (61 of 96 measured).
    assert sum(common_prefix(g, w) for g, w in zip(got, want, strict=True)) >= 0.5 * 96
    assert runner.kv_cache.view(torch.uint8).any()  # the cache was written


def test_a_prefix_cache_hit_reads_the_bytes_a_full_prefill_wrote_and_gives_the_same_tokens(tiny):
    cached = make_llm(tiny, kv_cache_dtype="fp8")
    uncached = make_llm(tiny, kv_cache_dtype="fp8", enable_prefix_caching=False)
    prompt, suffix = PROMPT_A[:16], [90, 91, 92, 93, 94, 95]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = cached.generate([prompt], params, "ns")[0].token_ids
    assert first == uncached.generate([prompt], params, "ns")[0].token_ids
    stored = cached_kv(cached, prompt, "ns")
    assert len(stored) == 4
    hit = cached.generate([prompt + suffix], params, "ns")[0].token_ids
    assert cached.metrics().prefix_cache_hit_tokens >= 16
    assert hit == uncached.generate([prompt + suffix], params, "ns")[0].token_ids
    # The blocks the hit read are still the bytes the first prefill stored, and a fresh engine's
    # prefill of the same tokens stores the same bytes (quantization is deterministic).
    again = make_llm(tiny, kv_cache_dtype="fp8")
    again.generate([prompt], ONE, "ns")
    fresh = cached_kv(again, prompt, "ns")
    assert stored.keys() == fresh.keys()
    assert all(same_bytes(stored[h], fresh[h]) for h in stored)
    assert all(same_bytes(kv, stored[h]) for h, kv in cached_kv(cached, prompt, "ns").items())


def test_chunk_reuse_with_rerotation_runs_on_an_fp8_cache_close_to_auto(tiny):
    def reuse(**args) -> tuple[LLM, torch.Tensor]:
        llm = make_llm(tiny, num_kv_blocks=256, kv_reuse="chunks", chunk_miss="wait", **args)
        first_logits(llm.engine, MIXED)  # compiles every chunk
        return llm, first_logits(llm.engine, REORDERED)  # reuses them at new positions

    fp8, got = reuse(kv_cache_dtype="fp8")
    auto, want = reuse()
    for llm in (fp8, auto):
        planner = llm.engine.chunk_planner
        assert planner.num_chunks_reused == 6 and planner.num_chunks_in_place == 0
    assert torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert 1e-3 < err < 0.2 * want.abs().max().item(), err
    # The reuse itself is close to what the FP8 engine computes without it, as it is for "auto".
    full = first_logits(make_llm(tiny, kv_cache_dtype="fp8", enable_prefix_caching=False).engine, REORDERED)
    auto_full = first_logits(make_llm(tiny, enable_prefix_caching=False).engine, REORDERED)
    auto_gap = (want - auto_full).abs().max().item()
    assert (got - full).abs().max().item() < auto_gap + 0.2 * full.abs().max().item()


def test_an_fp8_block_evicted_to_the_host_comes_back_byte_identical(tiny):
    def host_llm(num_kv_blocks: int, **args) -> LLM:
        return make_llm(tiny, num_kv_blocks=num_kv_blocks, kv_cache_dtype="fp8", max_model_len=40,
                        host_kv_admit_uses=0, **args)  # fmt: skip

    roomy, tight = host_llm(64), host_llm(12, host_kv_blocks=16)
    host = tight.engine.block_manager.host_tier
    buffer = tight.engine.model_runner.host_kv
    assert buffer is not None and buffer.blocks.dtype == FP8_KV_DTYPE
    for llm in (roomy, tight):
        prompt_logits(llm.engine, PROMPT_A, "ns")
    before = cached_kv(tight, PROMPT_A, "ns")
    assert len(before) == 4
    for llm in (roomy, tight):
        for filler in FILLERS:
            prompt_logits(llm.engine, filler, "ns")
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 0, "the test must evict A from the GPU"
    for block_hash, kv in before.items():
        assert same_bytes(buffer.blocks[host._entries[block_hash].slot], kv)
    got = prompt_logits(tight.engine, PROMPT_A, "ns")
    assert (host.num_hits, host.num_swapped_in) == (4, 4)
    assert torch.equal(got, prompt_logits(roomy.engine, PROMPT_A, "ns"))
    restored = cached_kv(tight, PROMPT_A, "ns")
    assert restored.keys() == before.keys() and all(same_bytes(restored[h], before[h]) for h in before)


def test_calibrated_scales_from_the_model_are_used_on_every_path(tiny, monkeypatch):
    # Scales far from 1 (the loader sets model.kv_cache_scales from a checkpoint's k_scale/v_scale):
    # a store, attention or re-rotated copy that dropped one would be off by 20x or more.
    scales = torch.tensor([[0.05, 0.03], [0.02, 0.04]])
    load = model_runner_module.load_model

    def load_with_scales(*args, **kwargs):
        model, config = load(*args, **kwargs)
        model.kv_cache_scales = scales
        return model, config

    monkeypatch.setattr(model_runner_module, "load_model", load_with_scales)
    fp8 = make_llm(tiny, num_kv_blocks=256, kv_cache_dtype="fp8", kv_reuse="chunks", chunk_miss="wait")
    monkeypatch.undo()
    runner = fp8.engine.model_runner
    assert runner.kv_scales is not None and torch.equal(runner.kv_scales, scales)
    assert runner.kv_caches[1].k_scale.item() == pytest.approx(0.02)
    auto = make_llm(tiny, num_kv_blocks=256, kv_reuse="chunks", chunk_miss="wait")
    for prompt in random_prompts(3, 12, seed=1):
        want, got = prompt_logits(auto.engine, prompt, "x"), prompt_logits(fp8.engine, prompt, "x")
        err = (got - want).abs().max().item()
        assert 1e-3 < err < 0.2 * want.abs().max().item(), err
    # The stored codes use the range the scales leave them: |k| / 0.02 reaches far past |k| itself.
    assert runner.kv_cache[1, 0].float().abs().max() > 40
    for llm in (fp8, auto):
        first_logits(llm.engine, MIXED)
    got, want = first_logits(fp8.engine, REORDERED), first_logits(auto.engine, REORDERED)
    assert fp8.engine.chunk_planner.num_chunks_reused == 6
    err = (got - want).abs().max().item()
    assert 1e-3 < err < 0.2 * want.abs().max().item(), err
