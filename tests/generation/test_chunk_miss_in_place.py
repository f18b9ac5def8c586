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
    # The compiles queued behind run in steps of their own, so the request's step holds the
    # same rows as exact mode's: bit for bit again.
    assert torch.equal(serve(llm.engine, REORDERED), serve(exact.engine, REORDERED))
    planner = llm.engine.chunk_planner
    assert planner.num_reused_tokens == 0 and planner.num_chunks_reused == 0


def test_the_request_waits_for_nothing_and_its_compiles_queue_behind_it(tiny):
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    serve(llm.engine, MIXED)
    request_id = llm.engine.add_segmented_request(REORDERED, SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler = llm.engine.scheduler
    waiting = list(scheduler.waiting)
    assert [s.seq_id for s in waiting] == [request_id] and not waiting[0].waits_for
    # The three chunks' compiles, as background work behind every caller's request.
    assert len(scheduler.background) == 3 and all(s.background for s in scheduler.background)


def traced_batches(engine: LLMEngine) -> list:
    """Record every batch the scheduler builds from now on."""
    batches, schedule = [], engine.scheduler.schedule

    def traced():  # noqa: ANN202
        batch = schedule()
        batches.append(batch)
        return batch

    engine.scheduler.schedule = traced
    return batches


def test_background_compiles_never_share_a_step_with_a_callers_prompt(tiny):
    llm = make_llm(tiny, kv_reuse="chunks", chunk_miss="in_place")
    engine = llm.engine
    serve(engine, MIXED)
    batches = traced_batches(engine)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = engine.add_segmented_request(REORDERED, params)  # second misses: three compiles behind it
    engine.step()  # its prompt: the compiles wait
    assert len(engine.scheduler.background) == 3
    # Arrives after the compiles were queued; a question of its own, so it has a prompt to compute.
    other_question = PromptSegment.of("suffix", [75, 76, 77, 78, 79, 81], "user:y")
    later = engine.add_segmented_request([*MIXED[:-1], other_question], params)
    while engine.has_unfinished_requests():
        engine.step()
    for batch in batches:
        prompts = {e.seq.seq_id for e in batch.entries if not e.is_decode and not e.seq.background}
        compiles = {e.seq.seq_id for e in batch.entries if not e.is_decode and e.seq.background}
        assert not (prompts and compiles), batch
    # The later caller went first: its prompt ran in a step before any compile's.
    step_of = {}
    for i, batch in enumerate(batches):
        for e in batch.entries:
            step_of.setdefault("compile" if e.seq.background else e.seq.seq_id, i)
    assert step_of[first] < step_of[later] < step_of["compile"]
    # And the compiles ran all the same, while the callers decoded: the chunks are cached now.
    assert all(b.num_decode_tokens for b in batches if any(e.seq.background for e in b.entries))
    planner = engine.chunk_planner
    hits = planner.num_chunk_hits
    serve(engine, [HEAD, label(1), CHUNK_B, label(2), CHUNK_C, label(3), CHUNK_A, QUESTION])
    assert planner.num_chunk_hits == hits + 3


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
