"""Exact KV reuse is bit-for-bit full prefill: SmolLM2 on the CPU, a RAG prompt whose chunks come from the cache.

Alice's request leaves its head, labels and chunks in the prefix cache; Erin (same group, other
question) reuses them. Her logits and greedy tokens must equal, bit for bit, those of the same
prompt prefilled cold in an engine with an empty cache.

One intra-op thread: with several, a matmul splits its reduction by the number of rows it gets,
so a 30-row suffix prefill and a 400-row full prefill round differently (about 2e-5 here) with or
without a cache; that is the kernels' batch-shape dependence, not reuse.
"""

from __future__ import annotations

import pytest
import torch

from permissions.models import Principal
from rag.generator import GenerationRequest
from rag.pipeline import Rag
from rag.prompt_layout import lay_out
from rag.prompts import build_prompt
from rag.settings import load_settings
from rag.types import Hit

pytestmark = pytest.mark.slow

ALICE = Principal("alice", frozenset({"genomics"}))
ERIN = Principal("erin", frozenset({"genomics"}))
STEPS = 6


def hit(key: str, text: str) -> Hit:
    return Hit(chunk_id=sum(map(ord, key)), document_key=key, source=f"/d/{key}", chunk_index=0, text=text,
               score=1.0, title=key, acl=frozenset({"group:genomics"}))


SOURCES = [
    hit("gpu-reservation.txt", "The cryoem-res reservation holds gpu07 and gpu08 for the imaging group on weekdays."),
    hit("storage.md", "The genomics share is /data/genomics. It is backed up nightly; scratch lasts 30 days."),
]


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2_dir(model_cache):
    from generation.loader import resolve_model_dir

    return resolve_model_dir(None, model_cache)


def engine(model_dir):
    from generation.config import EngineConfig
    from generation.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=1536))


def greedy_with_logits(engine, ids: list[int], regions) -> tuple[list[int], torch.Tensor, int]:
    """Greedy tokens, the logits of every step, and the prompt tokens served from the cache."""
    from generation.engine.sequence import Sequence

    seq = Sequence(ids, max_tokens=STEPS, namespace=regions)
    engine.scheduler.add(seq)
    rows = []
    while engine.scheduler.has_unfinished():
        batch = engine.scheduler.schedule()
        logits = engine.model_runner.compute_logits(batch).cpu()
        sampled = {}
        for row, entry in zip(logits, batch.sampling_entries, strict=True):
            rows.append(row.clone())
            sampled[entry.seq.seq_id] = [int(row.argmax())]
        engine.scheduler.postprocess(batch, sampled)
    return seq.output_token_ids, torch.stack(rows), seq.num_cached_tokens


def test_a_prompt_whose_chunks_come_from_the_cache_equals_full_prefill(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from rag.prompt_layout import pad_token_id

    rag = Rag(load_settings(home=tmp_path / "home"))
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))

    def layout(principal: Principal, question: str):
        prompt = build_prompt(question, SOURCES)
        request = GenerationRequest(prompt.messages, segments=rag.cache_segments(prompt, SOURCES, principal))
        out = lay_out(request, tokenizer, 16, pad_token_id(tokenizer))
        assert out is not None
        return out

    warm, cold = engine(smollm2_dir), engine(smollm2_dir)
    alice = layout(ALICE, "Which GPU nodes does the imaging group hold?")
    greedy_with_logits(warm, alice.token_ids, alice.regions)
    erin = layout(ERIN, "How often is the genomics share backed up?")
    tokens, logits, cached = greedy_with_logits(warm, erin.token_ids, erin.regions)
    assert cached == erin.chunk_ends[-1]  # both chunks (and the head and labels) came from Alice's request
    cold_tokens, cold_logits, cold_cached = greedy_with_logits(cold, erin.token_ids, erin.regions)
    assert cold_cached == 0
    assert tokens == cold_tokens
    assert torch.equal(logits, cold_logits)
    rag.close()
