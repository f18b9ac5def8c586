"""Chunk KV reuse on the packaged SmolLM2 (a real model, real tokenizer): the engine matches the slow reference."""

from __future__ import annotations

import pytest
import torch

from generation import LLM
from generation.engine.prompt_segments import PromptSegment

from .chunk_reuse_reference import dense_forward, filled_ranges, reference_logits
from .test_chunk_reuse import first_logits

pytestmark = pytest.mark.slow

BS = 16
SOURCES = [
    ("Freezer log", "The -80 freezer in room 204 alarms at -65 C. Samples of study CHR-77 sit on shelf 3."),
    ("GPU guide", "Public users may run jobs on nodes gpu01-gpu08 in the gpu partition, at most 4 GPUs each."),
    ("Storage", "Project space is 10 TB per group; scratch is purged after 30 days without access."),
]


def _segments(tok, order: list[int]) -> list[PromptSegment]:
    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    pad = ids("\n")[0]

    def padded(x: list[int]) -> list[int]:
        return x + [pad] * (-len(x) % BS)

    head = PromptSegment.of("head", padded(ids("<|im_start|>user\nSources:\n\n")), "system")
    out = [head]
    for k, i in enumerate(order, 1):
        title, text = SOURCES[i]
        out += [PromptSegment.of("label", padded(ids(f"[{k}] ")), "user:ana"),
                PromptSegment.of("chunk", padded(ids(f"{title}\n{text}\n\n")), "acl:lab")]  # fmt: skip
    question = "Question: Which nodes can I use?<|im_end|>\n<|im_start|>assistant\n"
    return [*out, PromptSegment.of("suffix", ids(question), "user:ana")]


def test_engine_matches_the_reference_on_smollm2(smollm2_dir):
    llm = LLM(smollm2_dir, device="cpu", dtype=torch.float32, block_size=BS, num_kv_blocks=256, kv_reuse="chunks",
              chunk_miss="wait")  # fmt: skip
    first_logits(llm.engine, _segments(llm.tokenizer, [0, 1, 2]))
    later = _segments(llm.tokenizer, [2, 0, 1])
    assert filled_ranges(later, BS), "the test must reuse something"
    got = first_logits(llm.engine, later)
    assert llm.engine.chunk_planner.num_chunks_in_place == 0
    want = reference_logits(llm.model, later, BS)
    # 30 layers in fp32: rounding grows with depth, still far below the approximation's own effect.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    full, _ = dense_forward(llm.model, [t for s in later for t in s.token_ids])
    assert (full[-1] - got).abs().max() > 1e-2
