"""Multi-step decode batches launch lazily: they stop for a waiting request and when every request ended."""

from __future__ import annotations

import pytest
import torch

from generation import LLM, SamplingParams
from generation.engine import model_runner as model_runner_module
from generation.engine.async_engine import AsyncLLMEngine

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)
DEVICES = ["cpu", CUDA]
BS = 4
STEPS = 8
AHEAD = model_runner_module.LAUNCH_AHEAD
PROMPT_A = [5, 6, 7, 8, 9, 10, 11, 12, 13]
PROMPT_B = [100, 2, 3, 4, 5]
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("default")[0]


def make_llm(path, device: str = "cpu", **engine_args) -> LLM:
    # On CUDA the steps are queued asynchronously (events, CUDA graphs): the path that matters.
    return LLM(path, device=device, dtype=torch.float32, block_size=BS, num_scheduler_steps=STEPS, **engine_args)


def count_model_steps(llm: LLM) -> list[int]:
    """A counter of the model steps the runner launches (one per step_logits call)."""
    runner = llm.engine.model_runner
    calls = [0]
    real = runner.step_logits

    def counted(inputs):
        calls[0] += 1
        return real(inputs)

    runner.step_logits = counted
    return calls


def first_tokens(llm: LLM, prompt: list[int]) -> int:
    """Add prompt and step until its prefill has sampled; returns its request id."""
    rid = llm.engine.add_request(prompt, LONG)
    while not any(u.request_id == rid and u.new_token_ids for u in llm.engine.step()):
        pass
    return rid


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_stops_for_an_arrival_and_the_newcomer_joins_the_next_step(model_path, device):
    reference = make_llm(model_path, device).generate([PROMPT_A, PROMPT_B], LONG)
    llm = make_llm(model_path, device)
    engine = llm.engine
    a = first_tokens(llm, PROMPT_A)
    calls = count_model_steps(llm)
    # Nothing waiting: a full batch of 8 steps.
    (full,) = engine.step(arrived=lambda: False)
    assert full.request_id == a and len(full.new_token_ids) == STEPS and calls[0] == STEPS
    assert engine.get_metrics().num_batches_stopped_early == 0
    # A request arrives while the batch runs (the probe says so at its 3rd question, before step
    # 3 is launched): the batch ends after the steps already launched.
    answers = iter([False, False, True])
    calls[0] = 0
    (cut,) = engine.step(arrived=lambda: next(answers))
    assert len(cut.new_token_ids) == 3 and calls[0] == 3
    metrics = engine.get_metrics()
    assert metrics.num_batches_stopped_early == 1
    assert metrics.num_steps_skipped == STEPS - 3
    # One already waiting when the batch starts: only its first step runs.
    calls[0] = 0
    (cut2,) = engine.step(arrived=lambda: True)
    assert len(cut2.new_token_ids) == 1 and calls[0] == 1
    assert engine.get_metrics().num_steps_skipped == STEPS - 3 + STEPS - 1
    # The newcomer is prefilled in the very next step, with A's decode.
    b = engine.add_request(PROMPT_B, LONG)
    joined = {u.request_id: u.new_token_ids for u in engine.step()}
    assert set(joined) == {a, b} and len(joined[b]) == 1
    outputs = {a: list(reference[0].token_ids[: 1 + STEPS + 3 + 1]), b: []}
    outputs[a] += joined[a]
    outputs[b] += joined[b]
    while engine.has_unfinished_requests():
        for u in engine.step(arrived=lambda: True):
            outputs[u.request_id] += u.new_token_ids
    # Stopping early changes when tokens come, never which: the same as an uninterrupted run.
    assert outputs[a] == reference[0].token_ids and outputs[b] == reference[1].token_ids
    assert engine.get_metrics().num_kv_blocks_used == 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_no_launch_after_every_request_stopped(model_path, device):
    # Before lazy launching, all 8 steps ran on the device although the request stopped at its 3rd.
    reference = make_llm(model_path, device).generate([PROMPT_A], LONG)[0].token_ids
    llm = make_llm(model_path, device)
    stop = SamplingParams(max_tokens=40, stop_token_ids=[reference[3]])
    rid = llm.engine.add_request(PROMPT_A, stop)
    llm.engine.step()  # prefill: token 0
    calls = count_model_steps(llm)
    (update,) = llm.engine.step()
    assert update.request_id == rid and update.finished and update.new_token_ids == reference[1:4]
    # Steps 1..3 were read; the step launched ahead of the last read one is the only extra.
    assert calls[0] == 3 + AHEAD < STEPS
    assert llm.engine.get_metrics().num_batches_stopped_early == 0  # it ended, nothing was cut


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_batch_does_not_stop_for_an_arrival_it_cannot_take(model_path, device):
    # With max_num_seqs running there is no room for the newcomer: cutting the batch would only cost.
    llm = make_llm(model_path, device, max_num_seqs=1, max_num_batched_tokens=64)
    first_tokens(llm, PROMPT_A)
    (update,) = llm.engine.step(arrived=lambda: True)
    assert len(update.new_token_ids) == STEPS
    assert llm.engine.get_metrics().num_batches_stopped_early == 0


def test_the_async_engine_asks_about_queued_additions(model_path):
    llm = make_llm(model_path)
    engine = AsyncLLMEngine(llm.engine)
    try:
        assert engine._addition_waiting() is False
        with engine._cv:
            engine._pending_adds.append(object())  # what generate() queues, seen from the step thread
            assert engine._addition_waiting() is True
            engine._pending_adds.clear()
    finally:
        engine.shutdown()
