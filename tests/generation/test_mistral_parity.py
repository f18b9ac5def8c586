"""Mistral against Hugging Face's MistralForCausalLM: logits and greedy tokens, with and without a sliding window."""

from __future__ import annotations

import logging

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig, ModelConfig
from generation.engine.llm_engine import LLMEngine
from rag.errors import GenerationError, ModelError
from tests.generation.conftest import MISTRAL_WINDOW
from tests.generation.test_engine_parity import BS, hf_greedy, teacher_forced_logits

VARIANTS = ["mistral", "mistral_window"]
# Every prompt plus 20 new tokens fits the window but the last, which the window cuts short.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 2, 3, 4, 5], [42] * 17]
NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def make_llm(path, **engine_args) -> LLM:
    return LLM(path, device="cpu", dtype=torch.float32, block_size=BS, **engine_args)


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tiny_model_factory) -> tuple[str, LLM, object]:
    path, hf_model = tiny_model_factory(request.param)
    return request.param, make_llm(path), hf_model


def test_the_tiny_models_are_hf_mistral(tiny_model_factory):
    from transformers import MistralForCausalLM

    for variant in VARIANTS:
        path, hf_model = tiny_model_factory(variant)
        assert isinstance(hf_model, MistralForCausalLM)
        config = ModelConfig.from_model_dir(path)
        assert config.model_type == "mistral"
        assert not config.attention_bias and not config.qk_norm
    assert ModelConfig.from_model_dir(tiny_model_factory("mistral")[0]).head_dim == 32  # 64 / 4 heads would be 16


def test_context_len_is_the_window_only_when_it_is_shorter(tiny_model_factory):
    full = ModelConfig.from_model_dir(tiny_model_factory("mistral")[0])
    windowed = ModelConfig.from_model_dir(tiny_model_factory("mistral_window")[0])
    assert (full.sliding_window, full.context_len) == (None, 256)
    assert (windowed.sliding_window, windowed.context_len) == (MISTRAL_WINDOW, MISTRAL_WINDOW)
    wide = ModelConfig(**{**windowed.__dict__, "sliding_window": 4096})
    assert wide.context_len == 256  # a window longer than the context changes nothing
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**{**windowed.__dict__, "sliding_window": 0})


def test_full_forward_logits_match_hf(pair):
    _, llm, hf_model = pair
    # 31 tokens: inside the window, where sliding-window attention is full attention.
    ids = torch.tensor([list(range(3, 34)), [7, 1, 120, 3, 9, 9, 9, 125, 4] * 3 + [5, 6, 7, 8]])
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours = llm.model.compute_logits(llm.model(ids))
    assert ref.std() > 0.1  # logits are not all ~0, so the comparison means something
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_batch_matches_hf_generate(pair):
    variant, llm, hf_model = pair
    outs = llm.generate(PROMPTS, GREEDY)
    refs = [hf_greedy(hf_model, p, NEW) for p in PROMPTS]
    if variant == "mistral":
        assert [o.token_ids for o in outs] == refs
        assert all(o.finish_reason == "length" and o.num_output_tokens == NEW for o in outs)
        return
    # Windowed: each request is cut at the window (prompt + output <= 32) and equals HF up to there.
    for out, ref, prompt in zip(outs, refs, PROMPTS, strict=True):
        n = min(NEW, MISTRAL_WINDOW - len(prompt))
        assert out.token_ids == ref[:n]
        assert out.finish_reason == "length"
    assert outs[3].num_output_tokens == MISTRAL_WINDOW - 17 < NEW


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_logits_match_hf_through_chunks_decodes_and_prefix_hits(tiny_model_factory, variant):
    path, hf_model = tiny_model_factory(variant)
    config = EngineConfig(device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=12, max_num_seqs=4)
    engine = LLMEngine(path, config)
    # teacher_forced_logits appends 6 tokens to each prompt: all stay within the 32-token window.
    prompts = PROMPTS[:3] + [list(range(40, 66))]
    assert max(len(p) for p in prompts) + 6 <= MISTRAL_WINDOW
    assert teacher_forced_logits(engine, hf_model, prompts) > 0  # prompts were split into chunks
    hits_before = engine.block_manager.num_hit_tokens
    teacher_forced_logits(engine, hf_model, [prompts[3][:20] + [7, 7, 7]])
    assert engine.block_manager.num_hit_tokens - hits_before >= 20


def test_a_sliding_window_caps_the_context(tiny_model_factory, caplog):
    path, hf_model = tiny_model_factory("mistral_window")
    with caplog.at_level(logging.WARNING, logger="generation.engine.model_runner"):
        llm = make_llm(path)
    assert llm.engine.max_model_len == MISTRAL_WINDOW  # not max_position_embeddings (256)
    assert f"sliding window ({MISTRAL_WINDOW} tokens)" in caplog.text
    assert f"max_model_len capped at {MISTRAL_WINDOW}" in caplog.text
    with pytest.raises(GenerationError, match=f"context is {MISTRAL_WINDOW}"):
        llm.generate([[5] * MISTRAL_WINDOW], GREEDY)
    with pytest.raises(ModelError, match="longer than the model's context .*sliding_window"):
        make_llm(path, max_model_len=MISTRAL_WINDOW + 1)
    assert make_llm(path, max_model_len=16).engine.max_model_len == 16  # a shorter one is kept

    # Why the cap: past the window HF's sliding attention differs from the engine's full attention.
    ids = torch.tensor([[(7 * i) % 120 + 3 for i in range(MISTRAL_WINDOW + 16)]])
    with torch.no_grad():
        ref = hf_model(ids).logits[0]
        ours = llm.model.compute_logits(llm.model(ids))[0]
    torch.testing.assert_close(ours[:MISTRAL_WINDOW], ref[:MISTRAL_WINDOW], atol=1e-4, rtol=1e-4)
    assert (ours[MISTRAL_WINDOW:] - ref[MISTRAL_WINDOW:]).abs().max() > 1e-2


def test_without_a_window_the_context_is_max_position_embeddings(tiny_model_factory, caplog):
    with caplog.at_level(logging.WARNING, logger="generation.engine.model_runner"):
        llm = make_llm(tiny_model_factory("mistral")[0])
    assert llm.engine.max_model_len == 256
    assert "sliding window" not in caplog.text
