"""Chunk KV reuse in the engine (kv_reuse="chunks"): matches a slow reference, exact where it must be,
isolated by namespace, head and text (by counters), blended blocks never published, canonical ones never written."""

from __future__ import annotations

import random

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig
from generation.engine.llm_engine import LLMEngine
from generation.engine.prompt_segments import PromptSegment
from rag.errors import GenerationError

from .chunk_reuse_reference import dense_forward, filled_ranges, reference_logits

BS = 4
HEAD = PromptSegment.of("head", [5, 6, 7, 8, 9, 10, 11, 12], "sys")
CHUNK_A = PromptSegment.of("chunk", list(range(20, 32)), "acl:a")  # 3 blocks
CHUNK_B = PromptSegment.of("chunk", list(range(40, 48)), "acl:b")  # 2 blocks
CHUNK_C = PromptSegment.of("chunk", list(range(80, 96)), "acl:a")  # 4 blocks
QUESTION = PromptSegment.of("suffix", [70, 71, 72, 73, 74], "user:x")


def label(n: int) -> PromptSegment:
    return PromptSegment.of("label", [60 + n, 61, 62, 63], "user:x")


# The chunks land at positions other than right after the head (deltas 4, 20, 36 ...).
MIXED = [HEAD, label(1), CHUNK_A, label(2), CHUNK_B, label(3), CHUNK_C, QUESTION]
REORDERED = [HEAD, label(1), CHUNK_C, label(2), CHUNK_A, label(3), CHUNK_B, QUESTION]


def make_llm(path, **engine_args) -> LLM:
    # chunk_miss="wait": a request's missed chunks are compiled before it runs, so the next request
    # reuses them; these tests are about reuse ("in_place", the default, has its own tests).
    engine_args.setdefault("chunk_miss", "wait")
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=256, **engine_args)


def first_logits(engine: LLMEngine, segments: list[PromptSegment]) -> torch.Tensor:
    """fp32 logits [V] of the request's first sampled token, through the scheduler and runner.

    Chunk compiles the request waits for run first, as in engine.step; every step checks the
    block pool's invariants (copies only into private blocks, reference counts balance).
    """
    request_id = engine.add_segmented_request(segments, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        batch = engine.scheduler.schedule()
        assert not batch.is_empty
        engine.block_manager.check_invariants()
        logits = engine.model_runner.compute_logits(batch)
        rows = batch.sampling_entries
        engine.scheduler.postprocess(batch, {e.seq.seq_id: [int(logits[i].argmax())] for i, e in enumerate(rows)})
        for e in rows:
            engine._requests.pop(e.seq.seq_id, None)
        engine._compiles.clear()
        for i, e in enumerate(rows):
            if e.seq.seq_id == request_id:
                engine.block_manager.check_invariants()
                return logits[i]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("default")[0]


@pytest.mark.parametrize("variant", ["default", "llama3"])
@pytest.mark.parametrize("recompute", [{}, {"chunk_recompute": "fraction", "chunk_recompute_fraction": 0.5}])
def test_engine_matches_the_slow_reference(tiny_model_factory, variant, recompute):
    llm = make_llm(tiny_model_factory(variant)[0], kv_reuse="chunks", **recompute)
    ref_args = {"mode": recompute.get("chunk_recompute", "first_block"),
                "fraction": recompute.get("chunk_recompute_fraction", 0.15)}  # fmt: skip
    assert filled_ranges(REORDERED, BS, **ref_args), "the test must reuse something"
    first_logits(llm.engine, MIXED)  # compiles every chunk
    got = first_logits(llm.engine, REORDERED)  # reuses them at new positions
    planner = llm.engine.chunk_planner
    assert planner.num_chunks_reused == 6 and planner.num_chunks_in_place == 0
    want = reference_logits(llm.model, REORDERED, BS, **ref_args)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # And the approximation is one: full prefill of the same tokens differs by far more.
    full, _ = dense_forward(llm.model, [t for s in REORDERED for t in s.token_ids])
    assert (full[-1] - got).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_cuda_matches_the_slow_reference(tiny_model_factory):
    # The Triton prefill kernels with several runs of one sequence per step, and the copies on
    # the device, against the same dense reference (run on the GPU too, in fp32).
    llm = LLM(tiny_model_factory("llama3")[0], device="cuda", dtype=torch.float32, block_size=BS,
              num_kv_blocks=256, kv_reuse="chunks", chunk_miss="wait")  # fmt: skip
    first_logits(llm.engine, MIXED)
    got = first_logits(llm.engine, REORDERED)
    assert llm.engine.chunk_planner.num_chunks_reused == 6
    torch.testing.assert_close(got, reference_logits(llm.model, REORDERED, BS), rtol=0, atol=1e-4)


def test_the_reference_without_reuse_is_full_prefill(tiny_model_factory):
    # The oracle's own dense forward against Hugging Face: it would not catch much otherwise.
    path, hf = tiny_model_factory("default")
    llm = make_llm(path)
    ids = [t for s in MIXED for t in s.token_ids]
    ours, _ = dense_forward(llm.model, ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_recompute_all_equals_full_prefill(tiny):
    exact = make_llm(tiny, enable_prefix_caching=False)
    full = first_logits(exact.engine, REORDERED)
    llm = make_llm(tiny, kv_reuse="chunks", chunk_recompute="fraction", chunk_recompute_fraction=1.0)
    first_logits(llm.engine, MIXED)
    got = first_logits(llm.engine, REORDERED)
    assert llm.engine.chunk_planner.num_reused_tokens == 0
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)


def compiles_of(engine: LLMEngine) -> list:
    """Records every chunk compile the engine queues from now on (`_compile`'s calls)."""
    calls: list = []
    queue = engine._compile

    def recording(head, chunk):  # noqa: ANN001, ANN202
        calls.append(chunk)
        return queue(head, chunk)

    engine._compile = recording
    return calls


@pytest.mark.parametrize("chunk_miss", ["wait", "in_place"])
def test_a_chunk_right_after_the_head_publishes_its_own_canonical_kv(tiny, chunk_miss):
    # Right after the head, a missed chunk's prefill is its canonical chain head || chunk (the same
    # tokens, positions and namespaces): the request computes it, with no compile before or after,
    # exactly as full prefill does (bit for bit: the same one prefill of the same tokens). Then the
    # chunk is an exact prefix hit in that place, and a chunk-cache hit anywhere else.
    segments = [HEAD, CHUNK_A, QUESTION]
    full = first_logits(make_llm(tiny, enable_prefix_caching=False).engine, segments)
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss=chunk_miss)
    planner, compiles = llm.engine.chunk_planner, compiles_of(llm.engine)
    assert torch.equal(first_logits(llm.engine, segments), full)
    assert llm.engine.block_manager.num_hit_tokens == 0
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 1) and compiles == []

    # The same place again: an exact prefix hit of head || chunk, as exact mode's after the same prefill.
    # (The same request, not head || chunk alone: a CPU's kernels may round a token's KV differently
    # in a prefill of another length, as seen on a 2-core AVX2 EPYC; only the same prefill is bit-exact.)
    exact = make_llm(tiny)
    first_logits(exact.engine, segments)
    again = [HEAD, CHUNK_A, PromptSegment.of("suffix", [75, 76, 77], "user:y")]
    assert torch.equal(first_logits(llm.engine, again), first_logits(exact.engine, again))
    hits = len(HEAD.token_ids) + len(CHUNK_A.token_ids)
    assert llm.engine.block_manager.num_hit_tokens == exact.engine.block_manager.num_hit_tokens == hits
    assert planner.num_chunk_hits == 1 and planner.num_reused_tokens == 0  # no copy: an exact hit

    # Elsewhere: reused from the chain the first request published. CHUNK_B, missed but first,
    # publishes itself in turn: still no compile.
    first_logits(llm.engine, [HEAD, CHUNK_B, label(2), CHUNK_A, QUESTION])
    assert planner.num_chunk_hits == 2 and planner.num_chunks_reused == 1 and planner.num_reused_tokens > 0
    assert compiles == []
    assert planner.is_cached(HEAD, CHUNK_B)


def test_exact_mode_equals_full_prefill_and_copies_nothing(tiny):
    full = first_logits(make_llm(tiny, enable_prefix_caching=False).engine, REORDERED)
    llm = make_llm(tiny)  # kv_reuse="exact" by default
    assert llm.engine.chunk_planner is None
    first_logits(llm.engine, MIXED)
    got = first_logits(llm.engine, REORDERED)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)


def test_chunk_kv_is_isolated_by_namespace_head_and_text(tiny):
    llm = make_llm(tiny, kv_reuse="chunks")
    planner = llm.engine.chunk_planner
    first_logits(llm.engine, [HEAD, label(1), CHUNK_A, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 1)
    other_acl = PromptSegment.of("chunk", CHUNK_A.token_ids, "acl:b")
    first_logits(llm.engine, [HEAD, label(2), other_acl, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 2)
    edited_start = PromptSegment.of("chunk", (99, *CHUNK_A.token_ids[1:]), "acl:a")
    first_logits(llm.engine, [HEAD, label(2), edited_start, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 3)
    # An edited ending: the unchanged leading blocks are the same KV, but the chunk is a miss
    # (its compile computes the new tail), and the old tail is never served for the new text.
    edited_end = PromptSegment.of("chunk", (*CHUNK_A.token_ids[:-1], 99), "acl:a")
    first_logits(llm.engine, [HEAD, label(2), edited_end, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 4)
    other_head = PromptSegment.of("head", [*HEAD.token_ids[:-1], 13], "sys")
    first_logits(llm.engine, [other_head, label(2), CHUNK_A, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 5)
    other_head_ns = PromptSegment.of("head", HEAD.token_ids, "sys:other")
    first_logits(llm.engine, [other_head_ns, label(2), CHUNK_A, QUESTION])
    assert (planner.num_chunk_hits, planner.num_chunk_misses) == (0, 6)
    # The same chunk, namespace and head at another position: a hit, and the copies read
    # only blocks published under acl:a by this head.
    reused_before = planner.num_chunks_reused
    first_logits(llm.engine, [HEAD, label(3), CHUNK_B, label(4), CHUNK_A, QUESTION])
    assert planner.num_chunk_hits == 1 and planner.num_chunks_reused == reused_before + 2


def test_copies_read_only_the_chunks_own_namespace(tiny):
    llm = make_llm(tiny, kv_reuse="chunks")
    engine = llm.engine
    first_logits(engine, [HEAD, label(1), CHUNK_A, QUESTION])
    other_acl = PromptSegment.of("chunk", CHUNK_A.token_ids, "acl:b")
    request_id = engine.add_segmented_request([HEAD, label(2), other_acl, QUESTION], SamplingParams(max_tokens=1))
    compile_ids = set(engine.scheduler._seqs) - {request_id}
    assert len(compile_ids) == 1  # acl:b's own compile: acl:a's KV is not used
    batch = engine.scheduler.schedule()  # admits the compile; the request waits for it
    assert {e.seq.seq_id for e in batch.entries} == compile_ids and not batch.kv_copies


def test_blended_blocks_are_never_published_and_canonical_blocks_never_written(tiny):
    llm = make_llm(tiny, kv_reuse="chunks")
    engine, manager = llm.engine, llm.engine.block_manager
    first_logits(engine, MIXED)
    cached_before = {b.block_id: b for b in manager._cache.cached_blocks()}
    kv_before = engine.model_runner.kv_cache[:, :, sorted(cached_before)].clone()
    first_logits(engine, REORDERED)
    assert engine.chunk_planner.num_chunks_reused == 6
    after = manager._cache.cached_blocks()
    new = [b for b in after if b.block_id not in cached_before]
    # Only REORDERED's exact prefix is published: head and label 1 were cached by MIXED, then CHUNK_C's recomputed
    # first block, both before its first filled range; nothing from there on.
    assert [b.token_ids for b in new] == [CHUNK_C.token_ids[:BS]]
    still = [b for b in after if b.block_id in cached_before]
    assert len(still) == len(cached_before)
    assert torch.equal(engine.model_runner.kv_cache[:, :, sorted(cached_before)], kv_before)


def test_an_unaligned_chunk_is_computed_in_place(tiny):
    # A 3-token label puts the chunk off a block boundary: no copy can serve it.
    short_label = PromptSegment.of("label", [61, 62, 63], "user:x")
    segments = [HEAD, short_label, CHUNK_A, QUESTION]
    full = first_logits(make_llm(tiny, enable_prefix_caching=False).engine, segments)
    llm = make_llm(tiny, kv_reuse="chunks")
    first_logits(llm.engine, [HEAD, label(1), CHUNK_A, QUESTION])
    got = first_logits(llm.engine, segments)
    assert llm.engine.chunk_planner.num_chunks_in_place == 1
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)


def test_generation_runs_through_engine_step_and_frees_everything(tiny):
    llm = make_llm(tiny, kv_reuse="chunks")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.generate_segmented([MIXED, REORDERED, MIXED], params)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert outs[0].token_ids == outs[2].token_ids
    assert not llm.engine.has_unfinished_requests()
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        ([QUESTION], "at least a head and a suffix"),
        ([CHUNK_A, QUESTION], "first segment must be the head"),
        ([HEAD, CHUNK_A], "last segment must be the suffix"),
        ([HEAD, HEAD, QUESTION], "only labels and chunks"),
    ],
)
def test_malformed_segments_are_refused(tiny, segments, match):
    with pytest.raises(GenerationError, match=match):
        make_llm(tiny, kv_reuse="chunks").engine.add_segmented_request(segments)


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match="kv_reuse 'blend' is not supported; valid: exact, chunks"):
        EngineConfig(kv_reuse="blend")
    with pytest.raises(ValueError, match="enable_prefix_caching must be on"):
        EngineConfig(kv_reuse="chunks", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="valid: \\('first_block', 'fraction'\\)"):
        EngineConfig(chunk_recompute="cacheblend")
    with pytest.raises(ValueError, match="fraction must be in \\(0, 1\\]"):
        EngineConfig(chunk_recompute_fraction=0.0)


def test_runs_split_over_steps_by_the_token_budget_match_the_reference(tiny):
    # A 6-token step budget cuts runs mid-way and spreads one sequence's runs over many steps.
    llm = make_llm(tiny, kv_reuse="chunks", max_num_batched_tokens=6, max_num_seqs=4, max_model_len=128)
    first_logits(llm.engine, MIXED)
    got = first_logits(llm.engine, REORDERED)
    torch.testing.assert_close(got, reference_logits(llm.model, REORDERED, BS), rtol=0, atol=1e-5)


def test_a_preempted_blended_sequence_plans_again_and_balances_references(tiny):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = make_llm(tiny, kv_reuse="chunks")
    roomy.generate_segmented([MIXED], SamplingParams(max_tokens=1, ignore_eos=True))
    want = roomy.generate_segmented([REORDERED, REORDERED], params)
    # A pool too small for both to decode 40 tokens: the newer is preempted and readmitted.
    tight = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=38, kv_reuse="chunks",
                chunk_miss="wait")  # fmt: skip
    engine = tight.engine
    tight.generate_segmented([MIXED], SamplingParams(max_tokens=1, ignore_eos=True))
    ids = [engine.add_segmented_request(REORDERED, params) for _ in range(2)]
    outputs = {}
    while engine.has_unfinished_requests():
        for update in engine.step():
            if update.output is not None:
                outputs[update.request_id] = update.output.token_ids
        engine.block_manager.check_invariants()  # held sources, private copies, references
    assert engine.scheduler.num_preemptions > 0
    # The older one ran undisturbed. The readmitted one planned again: the pressure had evicted
    # some canonical chains by then, and those chunks were computed in place (exactly).
    assert outputs[ids[0]] == want[0].token_ids
    assert len(outputs[ids[1]]) == 40 and engine.chunk_planner.num_chunks_in_place > 0
    assert engine.block_manager.num_used_blocks == 0


def test_metrics_count_reused_and_computed_tokens_and_chunk_hits(tiny):
    llm = make_llm(tiny, kv_reuse="chunks")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate_segmented([MIXED], one)
    before = llm.metrics()
    # Three misses, compiled first; MIXED itself then reuses them (none is right after the head).
    first = sum(end - start for _, start, end in filled_ranges(MIXED, BS))
    assert (before.chunk_cache_hits, before.chunk_cache_misses, before.chunk_reused_tokens) == (0, 3, first)
    llm.generate_segmented([REORDERED], one)
    after = llm.metrics()
    reused = sum(end - start for _, start, end in filled_ranges(REORDERED, BS))
    assert (after.chunk_cache_hits, after.chunk_cache_misses) == (3, 3)
    assert after.chunk_reused_tokens - before.chunk_reused_tokens == reused
    # Every prompt token of REORDERED was a prefix hit, copied in, or computed: exactly one of them.
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    computed = after.prompt_computed_tokens - before.prompt_computed_tokens
    assert hits + reused + computed == sum(len(s.token_ids) for s in REORDERED)
    assert computed < sum(len(s.token_ids) for s in REORDERED) - len(HEAD.token_ids) - reused + 1
    exact = make_llm(tiny)
    exact.generate_segmented([MIXED], one)
    m = exact.metrics()
    assert (m.chunk_cache_hits, m.chunk_cache_misses, m.chunk_reused_tokens) == (0, 0, 0)
    assert m.prompt_computed_tokens == sum(len(s.token_ids) for s in MIXED)


def test_the_async_engine_streams_a_segmented_request_with_chunk_reuse(tiny):
    import asyncio

    from generation.engine.async_engine import AsyncLLMEngine

    want = make_llm(tiny, kv_reuse="chunks").generate_segmented([REORDERED], SamplingParams(max_tokens=5))
    engine = AsyncLLMEngine(make_llm(tiny, kv_reuse="chunks").engine)

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in engine.generate_segmented_updates(REORDERED, SamplingParams(max_tokens=5)):
            tokens += update.new_token_ids
        return tokens

    try:
        assert asyncio.run(run()) == want[0].token_ids
        # Compiled on the step thread (the lookups happen in add), then reused.
        m = engine.get_metrics()
        assert (m.chunk_cache_misses, m.chunks_computed_in_place) == (3, 0) and m.chunk_reused_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("chunk_miss", ["wait", "in_place"])
def test_a_chunk_reused_often_outlives_traffic_that_cycles_the_pool(tiny, chunk_miss):
    # Each reuse recomputes the chunk's first block and copies the rest; the first block is still
    # the head of the chain every lookup walks, so a reuse must refresh it too. Were only the
    # copied blocks refreshed, other traffic would evict the never-touched first block and every
    # later lookup would miss, however often the chunk is retrieved.
    llm = LLM(tiny, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=40,
              kv_reuse="chunks", chunk_miss=chunk_miss)  # fmt: skip
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def ask(n: int) -> list[PromptSegment]:  # another label each time: no exact prefix covers the chunk
        return [HEAD, label(n), CHUNK_A, QUESTION]

    for n in range(2):  # in_place compiles from the second miss on
        llm.generate_segmented([ask(n)], one)
    before = llm.metrics()
    rng = random.Random(0)
    rounds = 12
    for n in range(2, 2 + rounds):
        llm.generate_segmented([ask(n)], one)
        # Unrelated prompts, published and released: 28 blocks a round cycle the 40-block pool.
        fillers = [[rng.randrange(100, 128) for _ in range(25)] for _ in range(4)]
        llm.generate(fillers, one)
        llm.engine.block_manager.check_invariants()
    after = llm.metrics()
    assert after.chunk_cache_hits - before.chunk_cache_hits == rounds
    assert after.chunk_cache_misses == before.chunk_cache_misses
