"""Sampling: greedy limits, seeds, top-k/top-p filtering and the sampler's distribution."""

from __future__ import annotations

import math

import pytest
import torch

from generation import SamplingParams
from generation.layers.sampler import sample

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    from generation import LLM

    return LLM(tiny_model_factory("default")[0], device="cpu")


def tokens(llm, **kw) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True, **kw))[0].token_ids


def test_same_seed_same_tokens_even_in_a_different_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1234)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8], PROMPT, [9]], [others, params, others])
    assert batched[1].token_ids == alone


def test_different_seeds_give_different_tokens(llm):
    # The tiny random model's next-token distribution is wide, so 20 draws from two seeds
    # coinciding is vanishingly unlikely.
    runs = {tuple(tokens(llm, temperature=1.0, seed=s)) for s in range(4)}
    assert len(runs) == 4
    assert tuple(tokens(llm)) not in runs  # and none of them is the greedy path


def test_top_k_1_is_greedy(llm):
    assert tokens(llm, temperature=1.5, top_k=1, seed=7) == tokens(llm)


def test_tiny_top_p_is_greedy(llm):
    assert tokens(llm, temperature=1.5, top_p=1e-6, seed=7) == tokens(llm)


def draws(logits: list[float], n: int, **kw) -> torch.Tensor:
    params = SamplingParams(**kw)
    gen = torch.Generator().manual_seed(0)
    batch = torch.tensor([logits] * n)
    return sample(batch, [params] * n, [gen] * n)


def test_temperature_sampling_follows_the_softmax():
    probs = [0.6, 0.25, 0.1, 0.05]
    got = draws([math.log(p) for p in probs], 4000, temperature=1.0)
    freq = torch.bincount(got, minlength=4).float() / len(got)
    torch.testing.assert_close(freq, torch.tensor(probs), atol=0.03, rtol=0)


def test_low_temperature_sharpens():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    hot = (draws(logits, 2000, temperature=1.0) == 0).float().mean()
    cold = (draws(logits, 2000, temperature=0.2) == 0).float().mean()
    assert cold > 0.7 > hot


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draws(logits, 500, temperature=1.0, top_k=2).tolist()) == {0, 1}
    # 0.4 < 0.65, so the second token is needed; 0.4 + 0.3 >= 0.65, so the third is not.
    assert set(draws(logits, 500, temperature=1.0, top_p=0.65).tolist()) == {0, 1}
    assert set(draws(logits, 500, temperature=1.0, top_p=0.95).tolist()) == {0, 1, 2, 3}


def test_greedy_rows_and_sampled_rows_mix_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)]
    assert sample(logits, params, [None, None]).tolist() == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be in [0, 100]"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of integers >= 0"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_sampling_params_are_frozen_and_copy_lists():
    stop = ["\n\n"]
    params = SamplingParams(stop=stop)
    stop.append("x")
    assert params.stop == ["\n\n"]
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
