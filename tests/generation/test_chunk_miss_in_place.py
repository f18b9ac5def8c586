"""chunk_miss="in_place": a missed chunk is computed exactly in the request's own prefill (no wait),
and its canonical KV is compiled behind the request from its second miss on (the doorkeeper)."""

from __future__ import annotations

import pytest
import torch

from generation import LLM
from generation.config import EngineConfig
from generation.engine.chunk_doorkeeper import ChunkDoorkeeper
from generation.engine.llm_engine import LLMEngine
from generation.engine.prompt_segments import PromptSegment
from generation.sampling_params import SamplingParams

from .chunk_reuse_reference import reference_logits
from .test_chunk_reuse import BS, CHUNK_A, CHUNK_B, CHUNK_C, HEAD, MIXED, QUESTION, REORDERED, first_logits, label


def make_llm(path, **engine_args) -> LLM:
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=256, **engine_args)


def drain(engine: LLMEngine) -> None:
    """Run what is still queued (the compiles queued behind a request) to the end."""
    while engine.has_unfinished_requests():
        engine.step()


def serve(engine: LLMEngine, segments: list[PromptSegment]) -> torch.Tensor:
    logits = first_logits(engine, segments)
    drain(engine)
    return logits


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("default")[0]


def test_a_miss_is_computed_in_place_as_exact_mode_computes_it(tiny):
    # Same history in both engines, so the same exact prefix hits: every chunk missed, nothing
    # is copied, and the request computes exactly what kv_reuse="exact" computes.
    exact = make_llm(tiny)
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    assert torch.equal(serve(llm.engine, MIXED), serve(exact.engine, MIXED))
    # Here the compiles queued behind share the request's step, and CPU BLAS rounds a product
    # of more rows differently: equal to fp32 rounding, not bit for bit (the batch differs).
    torch.testing.assert_close(serve(llm.engine, REORDERED), serve(exact.engine, REORDERED), rtol=0, atol=1e-5)
    planner = llm.engine.chunk_planner
    assert planner.num_reused_tokens == 0 and planner.num_chunks_reused == 0


def test_the_request_waits_for_nothing_and_its_compiles_queue_behind_it(tiny):
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    serve(llm.engine, MIXED)
    request_id = llm.engine.add_segmented_request(REORDERED, SamplingParams(max_tokens=1, ignore_eos=True))
    waiting = list(llm.engine.scheduler.waiting)
    assert [s.seq_id for s in waiting][0] == request_id and not waiting[0].waits_for
    assert len(waiting) == 4  # the three chunks' compiles, after it


def test_compiles_start_at_the_second_miss_and_the_third_request_reuses(tiny):
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    engine, planner = llm.engine, llm.engine.chunk_planner
    serve(engine, MIXED)  # first sight of A, B, C: in place, no compile
    assert (planner.num_chunk_misses, planner.num_chunks_in_place, engine._compiles) == (3, 3, {})
    computed_first = engine.get_metrics().prompt_computed_tokens
    assert computed_first == sum(len(s.token_ids) for s in MIXED)  # nothing compiled on the side
    serve(engine, REORDERED)  # second miss of each: in place again, compiled behind
    assert (planner.num_chunk_misses, planner.num_chunks_in_place, planner.num_chunks_reused) == (6, 6, 0)
    third = [HEAD, label(1), CHUNK_B, label(2), CHUNK_C, label(3), CHUNK_A, QUESTION]  # no exact prefix past the head
    got = serve(engine, third)  # now every chunk's canonical KV is cached
    assert planner.num_chunk_hits == 3 and planner.num_chunks_reused == 3
    torch.testing.assert_close(got, reference_logits(llm.model, third, BS), rtol=0, atol=1e-5)


def test_misses_are_counted_per_namespace(tiny):
    # The same tokens under another document's namespace are another chunk: its misses do not
    # count towards the first one's compile, nor the other way round.
    other = PromptSegment.of("chunk", CHUNK_A.token_ids, "acl:other")
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    serve(llm.engine, [HEAD, label(1), CHUNK_A, QUESTION])
    serve(llm.engine, [HEAD, label(1), other, QUESTION])
    assert llm.engine.get_metrics().prompt_computed_tokens == 2 * (8 + 4 + 12 + 5) - 8 - 4  # head, label hit
    serve(llm.engine, [HEAD, label(1), other, label(2), CHUNK_A, QUESTION])  # second miss of both
    serve(llm.engine, [HEAD, label(1), CHUNK_A, label(2), other, QUESTION])
    planner = llm.engine.chunk_planner
    assert planner.num_chunk_hits == 2 and planner.num_chunks_reused == 1  # CHUNK_A's hit was an exact prefix


def test_in_place_is_the_default_and_wait_compiles_first(tiny):
    assert EngineConfig().chunk_miss == "in_place"
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="wait")
    request_id = llm.engine.add_segmented_request([HEAD, label(1), CHUNK_B, label(2), CHUNK_C, QUESTION])
    waiting = list(llm.engine.scheduler.waiting)
    assert waiting[-1].seq_id == request_id and len(waiting[-1].waits_for) == 2


def test_chunk_miss_is_validated():
    with pytest.raises(ValueError, match="chunk_miss 'later' is not supported; valid: wait, in_place"):
        EngineConfig(chunk_miss="later")


def test_the_doorkeeper_forgets_the_least_recently_missed():
    keeper = ChunkDoorkeeper(misses_to_compile=2, capacity=2)
    a, b, c = (PromptSegment.of("chunk", [n, n + 1], "acl:a") for n in (1, 10, 20))
    assert not keeper.on_miss(HEAD, a) and not keeper.on_miss(HEAD, b)
    assert not keeper.on_miss(HEAD, c)  # forgets a
    assert not keeper.on_miss(HEAD, a)  # a starts over (and b is forgotten)
    assert keeper.on_miss(HEAD, c) and keeper.on_miss(HEAD, a)
    assert len(keeper) == 0  # compiled chunks are not remembered
    with pytest.raises(ValueError):
        ChunkDoorkeeper(misses_to_compile=0)


def test_chunk_to_lead_names_a_missed_chunk_that_missed_before(tiny):
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    engine, planner = llm.engine, llm.engine.chunk_planner
    # Missed for the first time (likely cold): no preference, the caller's order stands.
    assert engine.chunk_to_lead(HEAD, [CHUNK_A, CHUNK_B, CHUNK_C]) is None
    # A leads and publishes itself; C misses in place (its first miss, remembered).
    serve(engine, [HEAD, CHUNK_A, label(2), CHUNK_C, QUESTION])
    assert planner.is_cached(HEAD, CHUNK_A) and not planner.is_cached(HEAD, CHUNK_C)
    counters = (planner.num_chunk_hits, planner.num_chunk_misses, len(engine._doorkeeper))
    # B and C are missed; C missed before, so it is likely to come again: it leads.
    assert engine.chunk_to_lead(HEAD, [CHUNK_B, CHUNK_A, CHUNK_C]) == 2
    assert engine.chunk_to_lead(HEAD, [CHUNK_A, CHUNK_B]) is None  # B never missed
    assert engine.chunk_to_lead(HEAD, [CHUNK_A]) is None  # all cached
    # Under another namespace nothing is cached nor missed before.
    other = PromptSegment.of("chunk", CHUNK_C.token_ids, "acl:b")
    assert engine.chunk_to_lead(HEAD, [CHUNK_A, other]) is None
    # Read-only: no lookup, miss or doorkeeper entry was counted by the probes.
    assert (planner.num_chunk_hits, planner.num_chunk_misses, len(engine._doorkeeper)) == counters
    # Leading with C as told: it publishes itself, and no compile is queued behind the request
    # (elsewhere, at its second miss, C would be computed in place and compiled once more).
    engine.add_segmented_request([HEAD, CHUNK_C, label(2), CHUNK_B, QUESTION],
                                 SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(engine.scheduler.waiting) == 1
    drain(engine)
    assert planner.is_cached(HEAD, CHUNK_C) and not planner.is_cached(HEAD, CHUNK_B)


def test_with_wait_the_first_missed_chunk_leads(tiny):
    # "wait" compiles every miss before the request runs: a missed chunk that leads costs no wait.
    engine = make_llm(tiny, kv_reuse="chunks", chunk_miss="wait").engine
    assert engine.chunk_to_lead(HEAD, [CHUNK_A, CHUNK_B]) == 0
    serve(engine, [HEAD, CHUNK_A, QUESTION])
    assert engine.chunk_to_lead(HEAD, [CHUNK_A, CHUNK_B]) == 1
    assert engine.chunk_to_lead(HEAD, [CHUNK_A]) is None


def test_an_engine_that_does_not_reuse_chunks_has_no_chunk_to_lead(tiny):
    assert make_llm(tiny).engine.chunk_to_lead(HEAD, [CHUNK_A, CHUNK_B]) is None


def test_a_chunks_chain_is_hashed_once_and_hashes_equal_a_fresh_computation(tiny, monkeypatch):
    # Probes of one chain (ordering probe, arrival lookup, admission plan) reuse its block hashes.
    from generation.engine import block_manager as bm_module
    from generation.engine import chunk_reuse
    from generation.engine.prefix_cache import hash_block

    engine = make_llm(tiny, kv_reuse="chunks").engine
    planner = engine.chunk_planner
    calls = []
    monkeypatch.setattr(bm_module, "hash_block", lambda *a: calls.append(a) or hash_block(*a))
    first = planner._probe(HEAD, CHUNK_A)
    hashed = len(calls)
    assert hashed == (first.num_tokens - 1) // BS  # every block a lookup may match, once
    again = planner._probe(HEAD, CHUNK_A)
    assert len(calls) == hashed and again.block_hashes == first.block_hashes
    assert again.block_hashes is not first.block_hashes  # each probe appends to a list of its own
    # Another namespace is another chain (the hashes carry it), not a hit on the remembered one.
    other = planner._probe(HEAD, PromptSegment.of("chunk", CHUNK_A.token_ids, "imaging"))
    head_blocks = len(HEAD.token_ids) // BS
    assert len(calls) == 2 * hashed and set(other.block_hashes).isdisjoint(first.block_hashes[head_blocks:])
    fresh = chunk_reuse._canonical_probe(HEAD, CHUNK_A)
    assert engine.block_manager.block_hashes(fresh, hashed) == first.block_hashes


def test_the_remembered_chains_are_bounded(tiny, monkeypatch):
    from generation.engine import chunk_reuse

    monkeypatch.setattr(chunk_reuse, "CHAIN_HASH_ENTRIES", 2)
    planner = make_llm(tiny, kv_reuse="chunks").engine.chunk_planner
    chunks = [PromptSegment.of("chunk", [7 + i] * (2 * BS), None) for i in range(3)]
    for chunk in chunks:
        planner._probe(HEAD, chunk)
    assert list(planner._chain_hashes) == [(HEAD, chunks[1]), (HEAD, chunks[2])]  # the oldest went
