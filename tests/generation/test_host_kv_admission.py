"""Host tier admission (EngineConfig.host_kv_admit_uses): only blocks used on the GPU are copied out."""

from __future__ import annotations

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig
from generation.engine.host_kv_tier import HostKVTier
from generation.engine.prompt_segments import PromptSegment

from .test_chunk_reuse import HEAD, QUESTION, first_logits, label
from .test_host_kv_tier import BS, FILLERS, ONE, PROMPT_A, RecordingCopier, gpu_cached_tokens, key


def test_a_block_used_fewer_times_than_admit_uses_is_not_copied_out():
    copier = RecordingCopier()
    host = HostKVTier(4, copier)  # the default: one use on the GPU
    assert host.admit_uses == 1
    host.save(7, *key(1), uses=0)
    assert copier.calls == [] and host.find(*key(1)) is None
    assert (host.num_not_admitted, host.num_swapped_out, host.num_used_blocks) == (1, 0, 0)
    host.save(8, *key(10), uses=1)
    assert copier.calls == [("out", 8, 0)] and host.find(*key(10)) == 0
    strict = HostKVTier(4, RecordingCopier(), admit_uses=3)
    strict.save(1, *key(1), uses=2)
    strict.save(2, *key(10), uses=3)
    assert strict.find(*key(1)) is None and strict.find(*key(10)) is not None
    every = HostKVTier(4, RecordingCopier(), admit_uses=0)
    every.save(1, *key(1), uses=0)
    assert every.find(*key(1)) is not None and every.num_not_admitted == 0


def test_admission_is_checked():
    assert EngineConfig().host_kv_admit_uses == 1
    with pytest.raises(ValueError, match="host_kv_admit_uses must be >= 0"):
        EngineConfig(host_kv_blocks=8, host_kv_admit_uses=-1)
    with pytest.raises(ValueError, match="host_kv_admit_uses must be >= 0"):
        HostKVTier(4, RecordingCopier(), admit_uses=-1)


def tight_llm(path, **args) -> LLM:
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, max_model_len=40, num_kv_blocks=12,
               host_kv_blocks=16, **args)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("default")[0]


def test_a_prompt_seen_once_stays_off_the_host_and_a_reused_one_comes_back(tiny):
    llm = tight_llm(tiny)
    roomy = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, max_model_len=40, num_kv_blocks=64)
    host = llm.engine.block_manager.host_tier
    llm.generate([PROMPT_A], ONE, "ns")
    for filler in FILLERS:
        llm.generate([filler], ONE, "ns")
    assert gpu_cached_tokens(llm, PROMPT_A, "ns") == 0, "the test must evict A from the GPU"
    # Every block so far was computed once and never shared: none crossed the bus.
    assert host.num_swapped_out == 0 and host.num_not_admitted > 0
    assert llm.engine.num_cached_prefix_tokens(PROMPT_A, "ns") == 0
    # A second request hits A's 4 leading blocks (one use each): evicted again, they are kept.
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([PROMPT_A], ONE, "ns")
    llm.generate([PROMPT_A], ONE, "ns")
    for filler in FILLERS:
        llm.generate([filler], ONE, "ns")
    assert gpu_cached_tokens(llm, PROMPT_A, "ns") == 0
    assert host.num_swapped_out == 4
    hits = host.num_hits
    assert llm.generate([PROMPT_A], params, "ns")[0].token_ids == roomy.generate([PROMPT_A], params, "ns")[0].token_ids
    assert host.num_hits - hits == 4
    m = llm.metrics()
    assert m.host_kv_not_admitted == host.num_not_admitted > 0
    llm.engine.block_manager.check_invariants()


def test_a_compiled_chunk_counts_as_used_so_it_reaches_the_host_before_its_first_reuse(tiny):
    # chunk_miss="in_place": the chunk is computed in place twice, and the second miss queues its
    # compile. The fillers evict the canonical chain before any request reused it: the compile's
    # one use (the doorkeeper's evidence) is what admits it, and the third request copies it back.
    chunk = PromptSegment.of("chunk", list(range(20, 32)), "acl:a")
    args = dict(kv_reuse="chunks", chunk_miss="in_place")
    tight = tight_llm(tiny, **args)
    roomy = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, max_model_len=40, num_kv_blocks=64, **args)
    for llm in (tight, roomy):
        llm.generate_segmented([[HEAD, label(1), chunk, QUESTION]], ONE)
        llm.generate_segmented([[HEAD, label(2), chunk, QUESTION]], ONE)
    planner, host = tight.engine.chunk_planner, tight.engine.block_manager.host_tier
    assert planner.canonical_blocks(HEAD, chunk), "the second miss compiles the chunk"
    for filler in FILLERS:
        tight.generate([filler], ONE, "acl:a")
    assert planner.canonical_blocks(HEAD, chunk) == [], "the test must evict the chunk from the GPU"
    assert host.num_swapped_out >= 3  # the chunk's three blocks; one-off prompts' blocks are not
    hits = host.num_hits
    got = first_logits(tight.engine, [HEAD, label(3), chunk, QUESTION])
    want = first_logits(roomy.engine, [HEAD, label(3), chunk, QUESTION])
    assert host.num_hits - hits >= 3
    assert planner.num_chunks_reused == roomy.engine.chunk_planner.num_chunks_reused
    assert torch.equal(got, want)
