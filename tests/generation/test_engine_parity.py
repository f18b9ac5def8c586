"""The paged engine against Hugging Face: logits and greedy tokens with chunking, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig
from generation.engine.llm_engine import LLMEngine
from generation.engine.scheduler import ScheduledBatch
from generation.engine.sequence import Sequence
from rag.errors import ModelError

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)
DEVICES = ["cpu", CUDA]
BS = 4  # small blocks: prompts span many, so block tables, boundaries and partial blocks are all exercised
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 2, 3, 4, 5], [42] * 17, list(range(20, 60))]
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def make_llm(path, device: str, **engine_args) -> LLM:
    # fp32 everywhere: greedy tokens must equal HF's fp32 run, not just come close.
    return LLM(path, device=device, dtype=torch.float32, block_size=BS, **engine_args)


@pytest.fixture(scope="module")
def default_model(tiny_model_factory):
    return tiny_model_factory("default")


class GreedyRefs(dict):
    """HF's greedy continuation of each prompt (a tuple), computed on first use."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        self.hf_model = hf_model

    def __missing__(self, prompt: tuple[int, ...]) -> list[int]:
        self[prompt] = hf_greedy(self.hf_model, list(prompt))
        return self[prompt]


@pytest.fixture(scope="module")
def refs(default_model) -> GreedyRefs:
    return GreedyRefs(default_model[1])


def ref_tokens(refs: GreedyRefs, prompts: list[list[int]]) -> list[list[int]]:
    return [refs[tuple(p)] for p in prompts]


# --------------------------------------------------------------------------------------------------
# Logits, step by step, with the scheduler in the loop
# --------------------------------------------------------------------------------------------------


def teacher_forced_logits(engine: LLMEngine, hf_model, prompts: list[list[int]], namespace: str | None = None) -> int:
    """Run prompts + fixed continuations through scheduler and runner; every sampled row must match HF.

    The continuation is fixed (not sampled) so HF's full forward gives the reference logits at
    every position. Returns how many entries were prefill chunks that did not sample.
    """
    rng = random.Random(len(prompts))
    forced = {}
    seqs = []
    for prompt in prompts:
        seq = Sequence(prompt, max_tokens=6, namespace=namespace)
        forced[seq.seq_id] = prompt + [rng.randrange(3, 128) for _ in range(6)]
        engine.scheduler.add(seq)
        seqs.append(seq)
    with torch.no_grad():
        ref = {s.seq_id: hf_model(torch.tensor([forced[s.seq_id]])).logits[0] for s in seqs}
    chunks = 0
    while engine.scheduler.has_unfinished():
        batch: ScheduledBatch = engine.scheduler.schedule()
        logits = engine.model_runner.compute_logits(batch).cpu()
        sampled = {}
        for row, entry in zip(logits, batch.sampling_entries, strict=True):
            seq = entry.seq
            # The row predicts token number seq.num_tokens from everything before it.
            torch.testing.assert_close(row, ref[seq.seq_id][seq.num_tokens - 1], atol=1e-4, rtol=1e-4)
            sampled[seq.seq_id] = [forced[seq.seq_id][seq.num_tokens]]
        chunks += sum(not e.samples for e in batch.entries)
        engine.scheduler.postprocess(batch, sampled)
    assert all(s.output_token_ids == forced[s.seq_id][s.num_prompt_tokens :] for s in seqs)
    return chunks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["default", "qwen2", "qwen3"])
def test_paged_logits_match_hf_through_chunks_decodes_and_prefix_hits(tiny_model_factory, variant, device):
    path, hf_model = tiny_model_factory(variant)
    config = EngineConfig(device=device, dtype="float32", block_size=BS, max_num_batched_tokens=12, max_num_seqs=4)
    engine = LLMEngine(path, config)
    chunks = teacher_forced_logits(engine, hf_model, PROMPTS)
    assert chunks > 0  # the 12-token budget split prompts, and decodes rode along with the chunks
    # Second round: prompts that share long prefixes with the first round's, served from the cache.
    hits_before = engine.block_manager.num_hit_tokens
    teacher_forced_logits(engine, hf_model, [PROMPTS[4][:30] + [7, 7, 7], PROMPTS[3] + [1, 2, 3, 4, 5]])
    assert engine.block_manager.num_hit_tokens - hits_before >= 28 + 16


# --------------------------------------------------------------------------------------------------
# Greedy tokens through LLM.generate
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_one_request_and_a_mixed_batch_match_hf(default_model, refs, device, steps):
    llm = make_llm(default_model[0], device, num_scheduler_steps=steps)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == refs[tuple(PROMPTS[0])]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref_tokens(refs, PROMPTS)
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_hits_give_the_same_tokens(default_model, refs, device, steps):
    llm = make_llm(default_model[0], device, num_scheduler_steps=steps)
    first = llm.generate([PROMPTS[4]], GREEDY)[0]
    hits = llm.metrics().prefix_cache_hit_tokens
    assert hits == 0
    # A prompt sharing 32 tokens, and one extending the first request's prompt with its own output:
    # the second hits blocks whose KV was written by decode steps.
    shared = PROMPTS[4][:32] + [9, 8, 7, 6, 5]
    extended = PROMPTS[4] + first.token_ids[:10] + [3]
    outs = llm.generate([shared], GREEDY) + llm.generate([extended], GREEDY)
    assert llm.metrics().prefix_cache_hit_tokens - hits >= 32 + 48
    assert [o.token_ids for o in outs] == ref_tokens(refs, [shared, extended])
    again = llm.generate([PROMPTS[4]], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert llm.metrics().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_gives_the_same_tokens(default_model, refs, device, steps):
    llm = make_llm(default_model[0], device, max_num_batched_tokens=8, max_num_seqs=4, num_scheduler_steps=steps)
    batches: list[ScheduledBatch] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule() -> ScheduledBatch:
        batches.append(schedule())
        return batches[-1]

    llm.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref_tokens(refs, PROMPTS)
    assert any(not e.samples for b in batches for e in b.entries)  # a prompt was split
    assert any(b.num_decode_tokens and b.num_prefill_tokens for b in batches)  # decodes ran beside a chunk
    assert max(b.num_batched_tokens for b in batches) <= 8
    assert any(b.num_steps > 1 for b in batches) == (steps > 1)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_the_same_tokens(default_model, refs, device, steps, prefix_caching):
    # 12 blocks of 4 = 48 tokens of KV, while the five requests need 2 + 18 + ... = far more.
    llm = make_llm(
        default_model[0],
        device,
        num_kv_blocks=12,
        max_model_len=48,
        enable_prefix_caching=prefix_caching,
        num_scheduler_steps=steps,
    )
    prompts = PROMPTS[:4] + [PROMPTS[4][:24]]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref_tokens(refs, prompts)
    llm.engine.block_manager.check_invariants()
    assert llm.metrics().num_kv_blocks_used == 0


@pytest.mark.parametrize("device", DEVICES)
def test_namespaces_never_share_kv(default_model, refs, device):
    llm = make_llm(default_model[0], device)
    prompt = PROMPTS[4]
    a = llm.generate([prompt], GREEDY, namespace="lab-a")[0]
    assert llm.metrics().prefix_cache_hit_tokens == 0
    b = llm.generate([prompt], GREEDY, namespace="lab-b")[0]
    none = llm.generate([prompt], GREEDY)[0]
    assert llm.metrics().prefix_cache_hit_tokens == 0  # same tokens, other namespaces: no hit
    a2 = llm.generate([prompt], GREEDY, namespace="lab-a")[0]
    assert llm.metrics().prefix_cache_hit_tokens == (len(prompt) - 1) // BS * BS
    assert a.token_ids == b.token_ids == none.token_ids == a2.token_ids == refs[tuple(prompt)]


@pytest.mark.parametrize("device", DEVICES)
def test_several_steps_per_batch_stop_where_one_step_does(default_model, refs, device):
    # Stop ids, max_tokens and max_model_len cut a request inside a batch of 8 steps; the tokens
    # after the cut are discarded and the request ends exactly as with one step per batch.
    path = default_model[0]
    prompts = PROMPTS + [[7] * 43]  # 43 + 5 = max_model_len: ends by length after 5 tokens
    stop_at = {0: refs[tuple(PROMPTS[0])][5], 2: refs[tuple(PROMPTS[2])][2]}
    max_tokens = [NEW, 4, NEW, 6, NEW, NEW]
    params = [
        SamplingParams(max_tokens=m, stop_token_ids=[stop_at[i]] if i in stop_at else [])
        for i, m in enumerate(max_tokens)
    ]
    outs = {}
    for steps in (1, 8):
        llm = make_llm(path, device, num_scheduler_steps=steps, max_model_len=48)
        outs[steps] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.metrics().num_kv_blocks_used == 0
        llm.engine.block_manager.check_invariants()
    assert outs[8] == outs[1]
    assert [reason for _, reason in outs[8]] == ["stop", "length", "stop", "length", "length", "length"]
    assert len(outs[8][5][0]) == 5


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_and_streams_do_not_depend_on_steps_per_batch(tiny_model_factory, device):
    path = tiny_model_factory("default", tokenizer=True)[0]
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    results = {}
    for steps in (1, 4):
        llm = LLM(path, device=device, dtype=torch.float32, num_scheduler_steps=steps)
        outs = llm.generate([[5, 6, 7], [9] * 11], [sampled, GREEDY])
        streamed = "".join(llm.stream([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)))
        results[steps] = ([o.token_ids for o in outs], streamed)
    assert results[4] == results[1]


def test_stream_closed_early_aborts_and_frees_blocks(tiny_model_factory):
    llm = make_llm(tiny_model_factory("default", tokenizer=True)[0], "cpu")
    stream = llm.stream(PROMPTS[4], SamplingParams(max_tokens=40, ignore_eos=True))
    next(stream)
    assert llm.metrics().num_running == 1 and llm.metrics().num_kv_blocks_used > 0
    stream.close()
    assert llm.metrics().num_running == 0 and llm.metrics().num_kv_blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


# --------------------------------------------------------------------------------------------------
# KV cache sizing
# --------------------------------------------------------------------------------------------------


def test_explicit_max_model_len_that_does_not_fit_is_refused(default_model):
    with pytest.raises(ModelError, match="holds 32 tokens .* max_model_len 64"):
        make_llm(default_model[0], "cpu", num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ModelError, match="longer than the model's context"):
        make_llm(default_model[0], "cpu", max_model_len=1000)


def test_implicit_max_model_len_shrinks_to_the_cache(default_model, caplog):
    llm = make_llm(default_model[0], "cpu", num_kv_blocks=8)
    assert llm.engine.max_model_len == 32
    assert "max_model_len lowered to 32" in caplog.text
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert (out.finish_reason, out.num_output_tokens) == ("length", 2)


# --------------------------------------------------------------------------------------------------
# CUDA graphs (GPU only)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager(default_model, dtype):
    engine = LLMEngine(default_model[0], EngineConfig(device="cuda", dtype=dtype, max_num_seqs=32, max_model_len=128))
    runner, scheduler = engine.model_runner, engine.scheduler
    assert runner.decode_graphs is not None and runner.prefill_graphs is not None
    rng = random.Random(0)
    compared = prefill_graphs = 0
    tol = 1e-4 if dtype == "float32" else 3e-2
    # 19 sequences finishing one by one: replays pad to the 32 bucket, then 16, 8, 4, 2 and 1;
    # then 3 more, whose prompts (a few sequences, few tokens) are a prefill graph's step.
    for num_seqs in (19, 3):
        for i in range(num_seqs):
            prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(1, 40))]
            scheduler.add(Sequence(prompt, max_tokens=1 + i * 3))
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            inputs = runner.prepare_inputs(batch)
            with torch.inference_mode():
                logits = runner.step_logits(inputs).clone()
                if inputs.decode_graph or inputs.prefill_graph:
                    # The replay wrote this step's KV; the eager pass writes the same values again.
                    hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches)
                    if not inputs.is_decode:
                        hidden = hidden[inputs.logits_indices]
                    eager = runner.model.compute_logits(hidden)
                    torch.testing.assert_close(logits.float(), eager.float(), atol=tol, rtol=tol)
                    compared += 1
                    prefill_graphs += inputs.prefill_graph
                tokens = logits.argmax(-1).tolist()
            # Only the batch's first step ran: one token each (a shorter run than scheduled is allowed).
            sampled = {e.seq.seq_id: [t] for e, t in zip(batch.sampling_entries, tokens, strict=True)}
            scheduler.postprocess(batch, sampled)
    assert compared > 20 and prefill_graphs > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_tokens_equal_eager_tokens(default_model):
    path = default_model[0]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(1, 60))] for _ in range(40)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        # fp32: bf16 rounding could flip a near-tie between two correct kernels' outputs.
        llm = LLM(path, device="cuda", dtype=torch.float32, enforce_eager=eager, max_num_seqs=64)
        assert (llm.engine.model_runner.decode_graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
