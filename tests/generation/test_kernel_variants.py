"""No Triton kernel compiles while the engine serves: every variant a step can need is compiled at start."""

from __future__ import annotations

import random

import pytest
import torch

from generation import SamplingParams
from generation.config import EngineConfig
from generation.engine.llm_engine import LLMEngine
from generation.layers.kernel_warmup import recording_triton_compiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_serving_varied_shapes_compiles_no_kernel(tiny_model_factory):
    pytest.importorskip("triton")
    path = tiny_model_factory("default")[0]
    # A long context so that table widths, split counts and batch sizes all vary widely.
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, block_size=16,
                                          max_num_seqs=64, num_scheduler_steps=8))  # fmt: skip
    with recording_triton_compiles() as compiled:
        rng = random.Random(0)
        for wave in range(6):
            # Waves of 1..40 requests of 1..200 prompt tokens, some sharing prefixes, arriving
            # mid-batch (arrived), so steps mix decodes and prefills of every size.
            shared = [rng.randrange(3, 120) for _ in range(rng.randrange(1, 120))]
            for _ in range(rng.randrange(1, 40)):
                own = [rng.randrange(3, 120) for _ in range(rng.randrange(1, 80))]
                prompt = (shared + own)[: rng.randrange(1, 200)] or [5]
                engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True))
            steps = 0
            while engine.has_unfinished_requests():
                engine.step(arrived=lambda: rng.random() < 0.3)
                steps += 1
                if wave % 2 and steps == 3:
                    engine.add_request([7] * rng.randrange(1, 150), SamplingParams(max_tokens=5, ignore_eos=True))
    assert compiled == []
