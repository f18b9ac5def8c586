"""The host KV tier (EngineConfig.host_kv_blocks): evicted published blocks go to host memory and come
back bit for bit, only under the exact same key, within a bounded buffer evicted by frequency and recency."""

from __future__ import annotations

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig
from generation.engine.block_manager import BlockManager
from generation.engine.host_kv_tier import HostKVTier
from generation.engine.llm_engine import LLMEngine
from generation.engine.prefix_cache import hash_block
from generation.engine.prompt_segments import PromptSegment
from generation.engine.sequence import Sequence

from .test_chunk_reuse import HEAD, QUESTION, first_logits, label

BS = 4
PROMPT_A = list(range(10, 27))  # 17 tokens: 4 full blocks, the last token in a fifth
FILLERS = [list(range(30 + 20 * k, 47 + 20 * k)) for k in range(3)]  # enough to evict A from a 12-block pool
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


class RecordingCopier:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def swap_out(self, block_id: int, slot: int) -> None:
        self.calls.append(("out", block_id, slot))

    def swap_in(self, slot: int, block_id: int) -> None:
        self.calls.append(("in", slot, block_id))

    def end_restore(self) -> None:
        self.calls.append(("end", -1, -1))


def key(n: int, namespace: str = "ns") -> tuple[bytes, str, None, tuple[int, ...]]:
    tokens = (n, n + 1, n + 2, n + 3)
    return hash_block(namespace, None, tokens), namespace, None, tokens


def test_the_host_index_finds_only_the_exact_key_and_copies_once():
    copier = RecordingCopier()
    host = HostKVTier(4, copier, admit_uses=0)
    h, ns, parent, tokens = key(1)
    host.save(7, h, ns, parent, tokens, uses=0)
    host.save(9, h, ns, parent, tokens, uses=2)  # evicted again after a restore: already here
    assert copier.calls == [("out", 7, 0)] and host.num_swapped_out == 1
    assert host.find(h, ns, parent, tokens) == 0
    # The same hash under another namespace, parent or text is not this entry (a forged hash).
    assert host.find(h, "other", parent, tokens) is None
    assert host.find(h, ns, b"\x00" * 32, tokens) is None
    assert host.find(h, ns, parent, (9, 9, 9, 9)) is None
    host.restore(0, h, 3)
    assert copier.calls[-1] == ("in", 0, 3) and (host.num_hits, host.num_swapped_in) == (1, 1)
    host.check_invariants()


def test_host_eviction_keeps_frequent_blocks_and_ages_old_ones():
    host = HostKVTier(2, RecordingCopier(), admit_uses=0)
    popular, one_off, newer = key(1), key(10), key(20)
    host.save(0, *popular, uses=5)
    host.save(1, *one_off, uses=0)
    host.save(2, *newer, uses=0)  # full: the least used goes, not the oldest
    assert host.find(*popular) is not None and host.find(*one_off) is None and host.find(*newer) is not None
    assert host.num_evictions == 1 and host.num_used_blocks == 2
    # Aging: each eviction raises the clock, so fresh entries soon outrank a popularity long past.
    for n in range(30, 30 + 4 * 8, 4):
        host.save(n, *key(n), uses=1)
    assert host.find(*popular) is None
    assert host.num_used_blocks == 2
    host.check_invariants()
    # Ties in priority go to the least recently used.
    tie = HostKVTier(2, RecordingCopier())
    tie.save(0, *key(1), uses=1)
    tie.save(1, *key(10), uses=1)
    tie.save(2, *key(20), uses=2)
    assert tie.find(*key(1)) is None and tie.find(*key(10)) is not None


def make_llm(path, **engine_args) -> LLM:
    # These tests move prompts seen once through the tier: admit every block unless a test says
    # otherwise (admission by uses has tests of its own).
    engine_args.setdefault("host_kv_admit_uses", 0)
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, max_model_len=40, **engine_args)


def prompt_logits(engine: LLMEngine, ids: list[int], namespace: str) -> torch.Tensor:
    """fp32 logits [V] of the prompt's first sampled token, through the scheduler and runner."""
    return run_to_first_logits(engine, engine.add_request(ids, ONE, namespace))


def run_to_first_logits(engine: LLMEngine, request_id: int) -> torch.Tensor:
    """Step a queued request (and whatever runs before it) to its first sampled token; its logits."""
    while True:
        batch = engine.scheduler.schedule()
        engine.block_manager.check_invariants()
        logits = engine.model_runner.compute_logits(batch)
        rows = batch.sampling_entries
        engine.scheduler.postprocess(batch, {e.seq.seq_id: [int(logits[i].argmax())] for i, e in enumerate(rows)})
        for e in rows:
            engine._requests.pop(e.seq.seq_id, None)
        engine.block_manager.check_invariants()
        for i, e in enumerate(rows):
            if e.seq.seq_id == request_id:
                return logits[i]


def cached_kv(llm: LLM, ids: list[int], namespace: str) -> dict[bytes, torch.Tensor]:
    """The KV of the prompt's published leading blocks now on the GPU, by block hash."""
    cache = llm.engine.block_manager._cache
    kv = llm.engine.model_runner.kv_cache
    return {b.block_hash: kv[:, :, b.block_id].clone() for b in cache.cached_blocks() if b.namespace == namespace
            and b.token_ids in {tuple(ids[i : i + BS]) for i in range(0, len(ids) - BS + 1, BS)}}  # fmt: skip


def gpu_cached_tokens(llm: LLM, ids: list[int], namespace: str) -> int:
    """Leading tokens of ids whose KV the GPU prefix cache holds (the host tier not counted)."""
    return llm.engine.block_manager.num_prefix_hit_tokens(Sequence([*ids, 0], max_tokens=1, namespace=namespace))


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("default")[0]


def test_a_round_trip_through_the_host_restores_identical_kv_logits_and_tokens(tiny):
    roomy = make_llm(tiny, num_kv_blocks=64)  # A never leaves the GPU
    tight = make_llm(tiny, num_kv_blocks=12, host_kv_blocks=16)
    manager, host = tight.engine.block_manager, tight.engine.block_manager.host_tier
    for llm in (roomy, tight):
        prompt_logits(llm.engine, PROMPT_A, "ns")
    before = cached_kv(tight, PROMPT_A, "ns")
    assert len(before) == 4
    for llm in (roomy, tight):
        for filler in FILLERS:
            prompt_logits(llm.engine, filler, "ns")
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 0, "the test must evict A from the GPU"
    assert host.num_swapped_out >= 4 and host.num_hits == 0
    # Host slots hold exactly what the GPU blocks held.
    for block_hash, kv in before.items():
        assert torch.equal(tight.engine.model_runner.host_kv.blocks[host._entries[block_hash].slot], kv)
    got = prompt_logits(tight.engine, PROMPT_A, "ns")
    want = prompt_logits(roomy.engine, PROMPT_A, "ns")
    assert (host.num_hits, host.num_swapped_in) == (4, 4)
    assert tight.metrics().prefix_cache_hit_tokens == roomy.metrics().prefix_cache_hit_tokens
    assert torch.equal(got, want)
    # The restored blocks are published again, holding identical KV.
    assert {h: torch.equal(kv, before[h]) for h, kv in cached_kv(tight, PROMPT_A, "ns").items()} == dict.fromkeys(
        before, True
    )
    # And generation from the restored prefix is the same, token for token.
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for filler in FILLERS:
        tight.generate([filler], ONE, "ns")
    hits_before = host.num_hits  # the fillers were evicted too, and some came back
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 0
    tokens = tight.generate([PROMPT_A], params, "ns")[0].token_ids
    assert host.num_hits - hits_before == 4
    assert tokens == roomy.generate([PROMPT_A], params, "ns")[0].token_ids
    manager.check_invariants()
    assert manager.num_used_blocks == 0


def test_no_host_hit_across_namespaces_or_for_other_text(tiny):
    llm = make_llm(tiny, num_kv_blocks=12, host_kv_blocks=16)
    host = llm.engine.block_manager.host_tier
    llm.generate([PROMPT_A], ONE, "acl:a")
    for filler in FILLERS:
        llm.generate([filler], ONE, "acl:a")
    assert host.num_swapped_out >= 4
    llm.generate([PROMPT_A], ONE, "acl:b")  # the same tokens in another permission domain
    assert host.num_hits == 0
    edited_first = [99, *PROMPT_A[1:]]
    llm.generate([edited_first], ONE, "acl:a")
    assert host.num_hits == 0
    # An edit in block 2: blocks 0 and 1 are the same KV and come back; 2 and 3 never do.
    edited_third = [*PROMPT_A[:9], 99, *PROMPT_A[10:]]
    llm.generate([edited_third], ONE, "acl:a")
    assert host.num_hits == 2
    llm.engine.block_manager.check_invariants()


def test_the_cached_prefix_probe_counts_host_blocks_of_the_probes_namespace_only(tiny):
    # rag/source_order.py orders sources by this probe: blocks the host tier holds are copied
    # back at admission, so they are cached too, but only for the same namespace, prefix and text.
    llm = make_llm(tiny, num_kv_blocks=12, host_kv_blocks=32)
    engine, host = llm.engine, llm.engine.block_manager.host_tier
    llm.generate([PROMPT_A], ONE, "acl:a")
    for filler in FILLERS:
        llm.generate([filler], ONE, "acl:a")
    assert gpu_cached_tokens(llm, PROMPT_A, "acl:a") == 0, "the test must evict A from the GPU"

    def counters() -> tuple[int, ...]:
        bm = engine.block_manager
        return (host.num_hits, host.num_swapped_in, host.num_swapped_out, bm.num_hit_tokens, bm.num_queried_tokens,
                bm.num_cached_blocks, bm.num_free_blocks)  # fmt: skip

    before = counters()
    assert engine.num_cached_prefix_tokens(PROMPT_A, "acl:a") == 16  # all 4 full blocks, on the host
    assert engine.num_cached_prefix_tokens(PROMPT_A, "acl:b") == 0  # another permission domain: nothing
    assert engine.num_cached_prefix_tokens(PROMPT_A) == 0
    assert engine.num_cached_prefix_tokens([99, *PROMPT_A[1:]], "acl:a") == 0  # other text
    assert engine.num_cached_prefix_tokens([*PROMPT_A[:9], 99, *PROMPT_A[10:]], "acl:a") == 8  # blocks 0, 1
    assert counters() == before, "a probe must change nothing: no restore, no count, no eviction"
    # Blocks 0 and 1 back on the GPU (a prompt sharing them), 2 and 3 still on the host: one run.
    llm.generate([[*PROMPT_A[:8], 98, 97]], ONE, "acl:a")
    assert gpu_cached_tokens(llm, PROMPT_A, "acl:a") == 8
    assert engine.num_cached_prefix_tokens(PROMPT_A, "acl:a") == 16
    assert engine.num_cached_prefix_tokens(PROMPT_A, "acl:b") == 0
    # What the probe promised is what admission takes from the caches.
    hits = engine.block_manager.num_hit_tokens
    llm.generate([PROMPT_A], ONE, "acl:a")
    assert engine.block_manager.num_hit_tokens - hits == 16
    engine.block_manager.check_invariants()


def test_the_host_tier_is_bounded_and_references_balance(tiny):
    llm = make_llm(tiny, num_kv_blocks=12, host_kv_blocks=3)
    manager = llm.engine.block_manager
    prompts = [list(range(5 + k, 22 + k)) for k in range(0, 60, 17)]
    for _ in range(2):
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), "ns")
        assert [len(o.token_ids) for o in outs] == [3] * len(prompts)
        manager.check_invariants()
    m = llm.metrics()
    assert m.host_kv_blocks == 3 and m.host_kv_blocks_used == 3
    assert m.host_kv_evictions > 0 and m.host_kv_swapped_out == m.host_kv_evictions + 3
    assert m.host_kv_swapped_in == m.host_kv_hits
    assert manager.num_used_blocks == 0
    assert manager.reset_prefix_cache() > 0 and manager.host_tier.num_used_blocks == 0


def test_chunk_kv_comes_back_from_the_host_instead_of_a_compile(tiny):
    chunk = PromptSegment.of("chunk", list(range(20, 32)), "acl:a")
    segments = [HEAD, label(1), chunk, QUESTION]
    roomy = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=64, max_model_len=40,
                kv_reuse="chunks", chunk_miss="wait")  # fmt: skip
    tight = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=12, max_model_len=40,
                kv_reuse="chunks", chunk_miss="wait", host_kv_blocks=32)  # fmt: skip
    for llm in (roomy, tight):
        llm.generate_segmented([segments], ONE)
        for filler in FILLERS:
            llm.generate([filler], ONE, "acl:a")
    planner = tight.engine.chunk_planner
    assert planner.canonical_blocks(HEAD, chunk) == [], "the test must evict the chunk from the GPU"
    got = first_logits(tight.engine, [HEAD, label(2), chunk, QUESTION])
    want = first_logits(roomy.engine, [HEAD, label(2), chunk, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (1, 1)  # no second compile
    assert tight.metrics().host_kv_hits >= 3
    assert planner.num_chunks_reused == roomy.engine.chunk_planner.num_chunks_reused == 2
    assert torch.equal(got, want)


def test_off_by_default_and_checked():
    assert EngineConfig().host_kv_blocks == 0
    with pytest.raises(ValueError, match="host_kv_blocks must be >= 0"):
        EngineConfig(host_kv_blocks=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching must be on"):
        EngineConfig(host_kv_blocks=8, enable_prefix_caching=False)


def test_off_by_default_there_is_no_host_buffer_and_the_counters_stay_zero(tiny):
    llm = make_llm(tiny, num_kv_blocks=12)
    assert llm.engine.block_manager.host_tier is None and llm.engine.model_runner.host_kv is None
    for prompt in [PROMPT_A, *FILLERS, PROMPT_A]:
        llm.generate([prompt], ONE, "ns")
    m = llm.metrics()
    assert (m.host_kv_blocks, m.host_kv_hits, m.host_kv_swapped_out, m.host_kv_swapped_in) == (0, 0, 0, 0)
    assert m.prefix_cache_hit_tokens == 0  # A was evicted and recomputed


def computed_and_released(bm: BlockManager, tokens: list[int]) -> None:
    """Run a prompt through the block manager alone: allocate, compute (publish), release."""
    seq = Sequence(tokens, max_tokens=1, namespace="ns")
    bm.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    bm.register_full_blocks(seq)
    bm.deallocate(seq)


def test_a_restore_never_reads_a_slot_that_its_own_block_take_reused():
    # A one-slot host tier: taking a GPU block for the restore evicts a GPU block to the host,
    # which takes the only slot, the one being restored. The restore must see that and stop.
    copier = RecordingCopier()
    bm = BlockManager(2, BS, host_tier=HostKVTier(1, copier, admit_uses=0))
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    computed_and_released(bm, a)
    computed_and_released(bm, b)  # evicts a's block to the host (slot 0)
    assert copier.calls == [("out", 0, 0)]
    holder = Sequence([50, 51], max_tokens=1, namespace="ns")
    bm.allocate(holder)  # the free block: only b's cached block is left to take
    restored = bm.restore_from_host(Sequence(a, max_tokens=1, namespace="ns"))
    assert restored == 0 and not [c for c in copier.calls if c[0] == "in"]
    assert copier.calls[-1] == ("out", 1, 0)  # b's block took the slot
    bm.check_invariants()
    bm.deallocate(holder)
    bm.check_invariants()
    assert bm.num_free_blocks == 2


def random_traffic(seed: int, num_prompts: int, num_repeats: int) -> list[tuple[list[int], str]]:
    """Prompts over three shared 2-block heads in two namespaces, then some of them again."""
    import random

    rng = random.Random(seed)
    heads = [list(range(3 + 9 * k, 11 + 9 * k)) for k in range(3)]
    prompts = [(rng.choice(heads) + [rng.randrange(40, 120) for _ in range(rng.randrange(1, 14))],
                rng.choice(["acl:a", "acl:b"])) for _ in range(num_prompts)]  # fmt: skip
    return prompts + rng.sample(prompts, num_repeats)


def assert_same_outputs_one_by_one(roomy: LLM, tight: LLM, prompts: list[tuple[list[int], str]]) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for ids, namespace in prompts:
        want = roomy.generate([ids], params, namespace)[0].token_ids
        assert tight.generate([ids], params, namespace)[0].token_ids == want
        tight.engine.block_manager.check_invariants()


def test_random_traffic_through_a_tight_pool_generates_what_a_roomy_one_does(tiny):
    # Shared heads, repeated prompts and two namespaces through a pool that keeps evicting: the
    # host tier moves blocks out and back all the time, and every output stays the same.
    roomy = make_llm(tiny, num_kv_blocks=128)
    tight = make_llm(tiny, num_kv_blocks=14, host_kv_blocks=24)
    assert_same_outputs_one_by_one(roomy, tight, random_traffic(0, 12, 8))
    m = tight.metrics()
    assert m.host_kv_hits > 0 and m.host_kv_swapped_out > 0
    assert tight.engine.block_manager.num_used_blocks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_round_trip_on_cuda_through_pinned_memory_restores_identical_kv(tiny):
    # Pinned host memory, copies out gathered into GPU staging and sent to host on their own
    # stream: the gather must read the block before its reuse overwrites it, and the copy back
    # land before the step reads it.
    def cuda_llm(num_kv_blocks: int, **args) -> LLM:
        return LLM(tiny, device="cuda", dtype=torch.float32, block_size=BS, max_model_len=40,
                   num_kv_blocks=num_kv_blocks, host_kv_admit_uses=0, **args)  # fmt: skip

    roomy, tight = cuda_llm(64), cuda_llm(12, host_kv_blocks=16)
    assert tight.engine.model_runner.host_kv.blocks.is_pinned()
    for llm in (roomy, tight):
        prompt_logits(llm.engine, PROMPT_A, "ns")
    before = cached_kv(tight, PROMPT_A, "ns")
    for llm in (roomy, tight):
        for filler in FILLERS:
            prompt_logits(llm.engine, filler, "ns")
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 0
    got = prompt_logits(tight.engine, PROMPT_A, "ns")
    want = prompt_logits(roomy.engine, PROMPT_A, "ns")
    assert tight.metrics().host_kv_hits == 4
    restored = cached_kv(tight, PROMPT_A, "ns")
    assert restored.keys() == before.keys() and all(torch.equal(restored[h], before[h]) for h in before)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_priority_heap_stays_bounded_under_many_uses():
    # A hot block restored again and again, with the tier never full: no eviction ever compacts.
    host = HostKVTier(8, RecordingCopier())
    hot = key(1)
    host.save(0, *hot, uses=1)
    for _ in range(1000):
        host.restore(0, hot[0], 5)
    assert len(host._heap) <= 4 * host.num_used_blocks + 64
    host.save(1, *key(10), uses=0)
    assert host.find(*hot) == 0


def test_chunk_kv_evicted_between_arrival_and_admission_comes_back_at_admission(tiny):
    chunk = PromptSegment.of("chunk", list(range(20, 32)), "acl:a")
    later = [HEAD, label(2), chunk, QUESTION]
    roomy = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=64, max_model_len=40,
                kv_reuse="chunks", chunk_miss="wait")  # fmt: skip
    tight = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=12, max_model_len=40,
                kv_reuse="chunks", chunk_miss="wait", host_kv_blocks=32)  # fmt: skip
    for llm in (roomy, tight):
        llm.generate_segmented([[HEAD, label(1), chunk, QUESTION]], ONE)
    engine, planner = tight.engine, tight.engine.chunk_planner
    request_id = engine.add_segmented_request(later, ONE)  # arrival: the chunk's KV is on the GPU
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (1, 1)
    # Before admission, other work pushes the canonical blocks out (straight through the pool:
    # those blocks' own KV is never read here).
    for filler in FILLERS:
        computed_and_released(engine.block_manager, filler)
    assert planner.canonical_blocks(HEAD, chunk) == []
    hits_before = engine.block_manager.host_tier.num_hits
    got = run_to_first_logits(engine, request_id)  # admission restores the chunk, then plans
    want = first_logits(roomy.engine, later)
    assert engine.block_manager.host_tier.num_hits > hits_before
    assert planner.num_chunks_in_place == 0
    assert planner.num_chunks_reused == roomy.engine.chunk_planner.num_chunks_reused
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staged_copies_out_never_race_a_reused_slot_or_block():
    # HostKVBuffer alone, on CUDA: a slot written twice keeps the later copy; a swap in of a slot
    # whose copy out is only noted gets that copy; a noted block overwritten right after still
    # leaves its old KV on the host; more noted blocks than staging holds all land.
    from generation.engine.host_kv_buffer import HostKVBuffer

    kv = torch.randn(2, 2, 8, 4, 1, 8, device="cuda")
    buffer = HostKVBuffer(kv, num_blocks=6, staging_blocks=2)
    assert buffer.num_staging_blocks == 2 and buffer.blocks.is_pinned()
    want = {b: kv[:, :, b].cpu() for b in range(8)}
    buffer.swap_out(0, 0)
    buffer.swap_out(1, 0)  # slot 0 again: block 1 must win
    buffer.swap_out(2, 1)
    buffer.before_step()
    kv[:, :, 1] = -1.0  # the step overwrites an evicted block right after the gather
    buffer.swap_out(3, 2)
    buffer.swap_in(2, 4)  # reads slot 2 while its copy out is only noted
    for b, slot in [(5, 3), (6, 4), (7, 5)]:  # more than staging holds
        buffer.swap_out(b, slot)
    buffer.synchronize()
    assert torch.equal(buffer.blocks[0], want[1]) and torch.equal(buffer.blocks[1], want[2])
    assert torch.equal(kv[:, :, 4].cpu(), want[3])
    for b, slot in [(5, 3), (6, 4), (7, 5)]:
        assert torch.equal(buffer.blocks[slot], want[b])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_random_traffic_on_cuda_through_a_tight_pool_generates_what_a_roomy_one_does(tiny, monkeypatch):
    # The CPU test above on the GPU, with staging smaller than a step's evictions (the overflow path).
    import generation.engine.host_kv_buffer as host_kv_buffer

    monkeypatch.setattr(host_kv_buffer, "STAGING_BLOCKS", 3)
    prompts = random_traffic(1, 16, 10)

    def cuda_llm(num_kv_blocks: int, **args) -> LLM:
        return LLM(tiny, device="cuda", dtype=torch.float32, block_size=BS, max_model_len=40,
                   num_kv_blocks=num_kv_blocks, host_kv_admit_uses=0, **args)  # fmt: skip

    roomy, tight = cuda_llm(128), cuda_llm(14, host_kv_blocks=24)
    assert tight.engine.model_runner.host_kv.num_staging_blocks == 3
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in roomy.generate([p for p, _ in prompts[:8]], params, "acl:a")]
    assert [o.token_ids for o in tight.generate([p for p, _ in prompts[:8]], params, "acl:a")] == want
    assert_same_outputs_one_by_one(roomy, tight, prompts)
    m = tight.metrics()
    assert m.host_kv_hits > 0 and m.host_kv_swapped_out > 3


def test_each_restore_ends_its_own_copy_group():
    # A step waits for the copies back of the restores whose blocks it reads, not for every copy
    # issued since the last step: each restore (one chain) closes its own group, and a restore
    # that copied nothing closes none.
    copier = RecordingCopier()
    bm = BlockManager(4, BS, host_tier=HostKVTier(8, copier, admit_uses=0))
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]
    for tokens in (a, b, c, [16, 17, 18, 19, 20], [21, 22, 23, 24, 25]):
        computed_and_released(bm, tokens)  # a 4-block pool: a and b go to the host
    copier.calls.clear()
    assert bm.restore_from_host(Sequence(a, max_tokens=1, namespace="ns")) == 1
    assert bm.restore_from_host(Sequence(c, max_tokens=1, namespace="ns")) == 0  # on the GPU still
    assert bm.restore_from_host(Sequence(b, max_tokens=1, namespace="ns")) == 1
    assert [kind for kind, *_ in copier.calls if kind != "out"] == ["in", "end", "in", "end"]
    bm.check_invariants()


def test_a_request_starts_its_copies_back_at_arrival(tiny):
    # Admission is too late to hide a copy back behind other work: the request's exact prefix
    # comes back when it is added, and its first token is the same as from a roomy pool.
    roomy = make_llm(tiny, num_kv_blocks=64)
    tight = make_llm(tiny, num_kv_blocks=12, host_kv_blocks=16)
    host = tight.engine.block_manager.host_tier
    for llm in (roomy, tight):
        prompt_logits(llm.engine, PROMPT_A, "ns")
        for filler in FILLERS:
            prompt_logits(llm.engine, filler, "ns")
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 0
    request_id = tight.engine.add_request(PROMPT_A, ONE, "ns")
    assert host.num_hits == 4, "the copies back start when the request arrives"
    assert gpu_cached_tokens(tight, PROMPT_A, "ns") == 16
    got = run_to_first_logits(tight.engine, request_id)
    assert host.num_hits == 4  # admission found them on the GPU: nothing copied twice
    assert torch.equal(got, prompt_logits(roomy.engine, PROMPT_A, "ns"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_back_overlap_steps_that_do_not_read_them_and_land_before_those_that_do():
    # HostKVBuffer alone, with blocks big enough (16 MiB) that a read racing the copy would see
    # the old contents: a step touching other blocks does not wait; one touching the block does,
    # and reads the restored KV; a block restored and evicted again before its copy landed is
    # gathered for its copy out only after it landed.
    from generation.engine.host_kv_buffer import HostKVBuffer

    kv = torch.randn(32, 2, 8, 64, 8, 128, device="cuda")
    buffer = HostKVBuffer(kv, num_blocks=4, staging_blocks=2)
    want = kv[:, :, 0].cpu()
    buffer.swap_out(0, 0)
    buffer.synchronize()
    for _ in range(3):
        kv[:, :, 3].zero_()
        buffer.swap_in(0, 3)
        buffer.end_restore()
        waited = buffer.landing.num_waited_blocks
        buffer.before_step(lambda: {5, 6})
        assert buffer.landing.num_waited_blocks == waited, "a step not reading block 3 must not wait for it"
        buffer.before_step(lambda: {3, 5})
        seen = kv[:, :, 3].clone()  # on the compute stream, like a step
        assert torch.equal(seen.cpu(), want)
    kv[:, :, 4].zero_()
    buffer.swap_in(0, 4)
    buffer.end_restore()
    buffer.swap_out(4, 1)  # evicted again at once: the gather must follow the copy back
    buffer.synchronize()
    assert torch.equal(buffer.blocks[1], want)
    landing = buffer.landing
    assert landing.num_in_flight_groups == 0
    assert landing.num_hidden_blocks + landing.num_waited_blocks == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_requests_queued_behind_others_on_cuda_generate_what_a_roomy_pool_does(tiny):
    # One sequence at a time: every request restored at arrival waits in the queue while others
    # run, so its copies back overlap their steps; the outputs are those of a pool that never
    # evicts, and every copy back is accounted for as hidden or waited.
    def cuda_llm(num_kv_blocks: int, **args) -> LLM:
        return LLM(tiny, device="cuda", dtype=torch.float32, block_size=BS, max_model_len=40,
                   num_kv_blocks=num_kv_blocks, max_num_seqs=1, host_kv_admit_uses=0, **args)  # fmt: skip

    roomy, tight = cuda_llm(128), cuda_llm(14, host_kv_blocks=24)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = random_traffic(2, 12, 12)
    for _ in range(2):
        want = [o.token_ids for o in roomy.generate([p for p, _ in prompts], params, "acl:a")]
        assert [o.token_ids for o in tight.generate([p for p, _ in prompts], params, "acl:a")] == want
    buffer = tight.engine.model_runner.host_kv
    buffer.synchronize()
    m = tight.metrics()
    assert m.host_kv_swapped_in > 0
    assert m.host_kv_copy_back_hidden + m.host_kv_copy_back_waited == m.host_kv_swapped_in
    tight.engine.block_manager.check_invariants()
