"""The same parity checks on a CUDA device (run on the GPU machine with `-m gpu`)."""

from __future__ import annotations

import copy

import pytest
import torch

from generation import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [100, 2, 3, 4, 5], [42] * 17]


@pytest.mark.parametrize("variant", ["default", "tied", "llama3", "qwen2"])
def test_fp32_greedy_matches_hf_on_cuda(tiny_model_factory, variant):
    path, hf_cpu = tiny_model_factory(variant)
    hf = copy.deepcopy(hf_cpu).to("cuda")
    llm = LLM(path, device="cuda", dtype=torch.float32)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=20)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_default_dtype_on_cuda_is_bf16_and_close_to_hf(tiny_model_factory):
    path, hf_cpu = tiny_model_factory("default")
    llm = LLM(path)
    assert llm.device.type == "cuda" and llm.dtype == torch.bfloat16
    hf = copy.deepcopy(hf_cpu).to("cuda", torch.bfloat16)
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    with torch.no_grad():
        ours = llm.model.compute_logits(llm.model(ids)).float()
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max() < 0.25


def test_seeded_sampling_is_reproducible_on_cuda(tiny_model_factory):
    llm = LLM(tiny_model_factory("default")[0], device="cuda")
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=3)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
