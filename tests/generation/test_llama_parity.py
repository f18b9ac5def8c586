"""Our Llama forward and greedy decoding against Hugging Face transformers on tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch

from generation import LLM, SamplingParams
from generation.layers.rotary import rope_inv_freq

VARIANTS = ["default", "tied", "llama3", "linear", "attention_bias", "qwen2", "qwen3"]
# HF generate is the slow part of this module: full greedy runs for the variants the generator
# must support; the others are covered by the logits tests.
GENERATE_VARIANTS = ["default", "tied", "llama3", "qwen2", "qwen3"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 2, 3, 4, 5], [42] * 17]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tiny_model_factory) -> tuple[LLM, object]:
    path, hf_model = tiny_model_factory(request.param)
    return LLM(path, device="cpu"), hf_model


@pytest.fixture(scope="module", params=GENERATE_VARIANTS)
def gen_pair(request, tiny_model_factory) -> tuple[LLM, object]:
    path, hf_model = tiny_model_factory(request.param)
    return LLM(path, device="cpu"), hf_model


@pytest.fixture(scope="module")
def hf_refs(gen_pair) -> list[list[int]]:
    """HF generate's 20 greedy tokens for each of PROMPTS, computed once per variant."""
    return [hf_greedy(gen_pair[1], prompt, 20) for prompt in PROMPTS]


def test_full_forward_logits_match_hf(pair):
    llm, hf_model = pair
    ids = torch.tensor([PROMPTS[0], [7, 1, 120, 3, 9, 9, 9, 125, 4]])
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours = llm.model.compute_logits(llm.model(ids))
    assert ref.std() > 0.1  # logits are not all ~0, so the comparison means something
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_single_prompt_matches_hf_generate(gen_pair, hf_refs):
    llm, _ = gen_pair
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.token_ids == hf_refs[0]
    assert out.finish_reason == "length"
    assert out.num_output_tokens == 20 and out.num_prompt_tokens == len(PROMPTS[0])


def test_greedy_batch_of_different_lengths_matches_hf_generate(gen_pair, hf_refs):
    llm, _ = gen_pair
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == PROMPTS  # order kept despite length sorting
    assert [o.token_ids for o in outs] == hf_refs


def test_rows_finishing_early_do_not_disturb_the_others(gen_pair, hf_refs):
    # Rows leave the batch at different steps, and 4 prompts with max_num_seqs=3 run as two
    # batches; greedy output must still be each prompt's own HF greedy prefix.
    path = gen_pair[0].model_dir
    llm = LLM(path, device="cpu", max_num_seqs=3)
    lengths = (3, 20, 1, 12)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(hf_refs, lengths, strict=True)]


@pytest.mark.parametrize("variant", ["default", "llama3", "linear"])
def test_rope_frequencies_match_hf(variant):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from generation.config import _rope_scaling, _rope_theta
    from tests.generation.conftest import tiny_hf_config

    hf_config = tiny_hf_config(variant)
    ours = rope_inv_freq(16, _rope_theta(hf_config), _rope_scaling(hf_config))
    torch.testing.assert_close(ours, LlamaRotaryEmbedding(hf_config).inv_freq)
    if variant != "default":
        assert not torch.allclose(ours, rope_inv_freq(16, 10000.0, {"rope_type": "default"}))


def test_bf16_matches_hf_in_bf16(tiny_model_factory):
    path, hf_model = tiny_model_factory("default")
    llm = LLM(path, device="cpu", dtype=torch.bfloat16)
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    assert llm.model.model.rotary_emb.inv_freq.dtype == torch.float32
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    ids = torch.arange(64).remainder(120)[None] + 3  # positions up to 63: rope precision counts
    with torch.no_grad():
        ours = llm.model.compute_logits(llm.model(ids)).float()
        ref = hf_bf16(ids).logits.float()
        fp32 = hf_model(ids).logits
    # We may differ from HF-in-bf16 by rounding, but by no more than bf16 rounding itself
    # moves HF away from fp32.
    assert (ours - ref).abs().mean() <= (ref - fp32).abs().mean()
    assert (ours - ref).abs().max() < 0.25
