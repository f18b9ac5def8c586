"""The block-aligned layout feeds the engine's position-independent chunk reuse (kv_reuse="chunks").

The layout's pieces, with the pipeline's namespaces, are the engine's segmented prompt: a chunk
cached by Alice's prompt is reused by Erin's at another position (the engine's chunk counters),
and never by a principal who reads the same text under another ACL.
"""

from __future__ import annotations

from dataclasses import replace

from permissions.models import Principal
from rag.generator import GenerationRequest
from rag.pipeline import Rag
from rag.prompt_layout import lay_out, pad_token_id
from rag.prompts import build_prompt
from tests.rag import tiny_engine
from tests.rag.test_kv_isolation import ALICE, DAVE, ERIN, X, Z

BS = 8

# The tiny engine's fixtures, shared with the other tests of the service's prompt layout.
model_dir = tiny_engine.model_dir
rag = tiny_engine.rag


def segmented(rag: Rag, tokenizer, principal: Principal, question: str, sources):
    from generation.engine.prompt_segments import PromptSegment

    prompt = build_prompt(question, sources)
    request = GenerationRequest(prompt.messages, segments=rag.cache_segments(prompt, sources, principal))
    out = lay_out(request, tokenizer, BS, pad_token_id(tokenizer))
    assert out is not None
    return [PromptSegment.of(kind, out.token_ids[start:end], ns) for kind, start, end, ns in out.pieces]


def run(engine, segments) -> None:
    from generation import SamplingParams

    engine.add_segmented_request(segments, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_chunk_is_reused_at_another_position_only_under_its_acl(model_dir, rag):
    from generation.config import EngineConfig
    from generation.engine.llm_engine import LLMEngine

    engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=512,
                                               kv_reuse="chunks", chunk_miss="wait"))
    tokenizer = engine.tokenizer
    run(engine, segmented(rag, tokenizer, ALICE, "Which GPU nodes can I use?", [X, Z]))
    before = engine.get_metrics()
    run(engine, segmented(rag, tokenizer, ERIN, "Where is the genomics share?", [Z, X]))
    after = engine.get_metrics()
    assert after.chunk_cache_hits - before.chunk_cache_hits == 2  # both chunks, each at a new position
    assert after.chunk_reused_tokens > before.chunk_reused_tokens
    copies = [replace(h, document_key=f"copy-of-{h.document_key}", acl=frozenset({"public"})) for h in (Z, X)]
    run(engine, segmented(rag, tokenizer, DAVE, "Where is the genomics share?", copies))
    final = engine.get_metrics()
    # Same ids, another ACL: both lookups miss Alice's copies and compile Dave's own (which his
    # prompt then reuses: that is his KV, not hers).
    assert final.chunk_cache_hits == after.chunk_cache_hits
    assert final.chunk_cache_misses - after.chunk_cache_misses == 2


def test_the_local_generator_sends_rag_prompts_as_segments_when_chunks_are_reused(model_dir, rag):
    """The service path (LocalGenerator.stream with engine_kv_reuse = "chunks"): Erin's prompt, with
    Alice's two chunks in the other order, takes both from the chunk cache; Dave's public copies of
    the same text take neither; with "exact" (the default) no segmented request is made at all."""
    from tests.rag.test_kv_isolation import request
    from tests.rag.tiny_engine import generate, local_generator

    generator = local_generator(model_dir, block_size=BS, num_kv_blocks=512, kv_reuse="chunks", chunk_miss="wait")
    try:
        generate(generator, request(rag, ALICE, "Which GPU nodes can I use?", [X, Z]))
        before = generator.metrics()
        generate(generator, request(rag, ERIN, "Where is the genomics share?", [Z, X]))
        after = generator.metrics()
        assert after.chunk_cache_hits - before.chunk_cache_hits == 2
        assert after.chunk_reused_tokens > before.chunk_reused_tokens
        copies = [replace(h, document_key=f"copy-of-{h.document_key}", acl=frozenset({"public"})) for h in (Z, X)]
        generate(generator, request(rag, DAVE, "Where is the genomics share?", copies))
        assert generator.metrics().chunk_cache_hits == after.chunk_cache_hits
    finally:
        generator.engine.shutdown()

    exact = local_generator(model_dir, block_size=BS, num_kv_blocks=512)
    try:
        generate(exact, request(rag, ALICE, "Which GPU nodes can I use?", [X, Z]))
        generate(exact, request(rag, ERIN, "Where is the genomics share?", [Z, X]))
        m = exact.metrics()
        assert m.chunk_cache_hits == 0 and m.chunk_cache_misses == 0 and m.chunk_reused_tokens == 0
    finally:
        exact.engine.shutdown()


def test_the_settings_reach_the_engine(tmp_path, model_dir):
    import pytest
    import torch

    from rag.generators.local import LocalGenerator
    from rag.settings import load_settings

    defaults = load_settings(home=tmp_path / "a")
    assert (defaults.engine_kv_reuse, defaults.engine_host_kv_blocks) == ("exact", 0)
    assert (defaults.engine_quantization, defaults.engine_kv_cache_dtype) == (None, "auto")
    chosen = load_settings(home=tmp_path / "b", engine_kv_reuse="chunks", engine_host_kv_blocks=4,
                           engine_quantization="fp8", engine_kv_cache_dtype="fp8")
    assert (chosen.engine_kv_reuse, chosen.engine_host_kv_blocks) == ("chunks", 4)
    with pytest.raises(Exception, match="engine_quantization"):
        load_settings(home=tmp_path / "e", engine_quantization="int4")
    with pytest.raises(Exception, match="engine_kv_reuse"):
        load_settings(home=tmp_path / "c", engine_kv_reuse="approximately")
    with pytest.raises(Exception, match="engine_host_kv_blocks"):
        load_settings(home=tmp_path / "d", engine_host_kv_blocks=-1)
    generator = LocalGenerator(model_dir, device="cpu", num_kv_blocks=64, kv_reuse=chosen.engine_kv_reuse,
                               host_kv_blocks=chosen.engine_host_kv_blocks, quantization=chosen.engine_quantization,
                               kv_cache_dtype=chosen.engine_kv_cache_dtype)
    try:
        config = generator.engine.engine.config
        assert (config.kv_reuse, config.host_kv_blocks) == ("chunks", 4)
        assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")
        runner = generator.engine.engine.model_runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn
        assert type(runner.model.model.layers[0].mlp.down_proj).__name__ == "Fp8Linear"
        assert generator.metrics().host_kv_blocks == 4
    finally:
        generator.engine.shutdown()


def test_the_step_budget_and_switch_interval_settings_reach_the_engine(tmp_path, model_dir):
    import pytest

    from rag.settings import load_settings

    defaults = load_settings(home=tmp_path / "a")
    assert (defaults.engine_max_num_batched_tokens, defaults.engine_switch_interval_ms) == (None, 0.1)
    with pytest.raises(Exception, match="engine_max_num_batched_tokens"):
        load_settings(home=tmp_path / "b", engine_max_num_batched_tokens=0)
    with pytest.raises(Exception, match="engine_switch_interval_ms"):
        load_settings(home=tmp_path / "c", engine_switch_interval_ms=-1)
    settings = load_settings(home=tmp_path / "d", generator=str(model_dir), device="cpu", engine_num_kv_blocks=64,
                             engine_max_num_seqs=4, engine_max_num_batched_tokens=96, engine_switch_interval_ms=0.5)
    rag = Rag(settings)
    try:
        engine = rag.generator.engine
        assert (engine.engine.config.max_num_seqs, engine.engine.config.max_num_batched_tokens) == (4, 96)
        assert not engine._shorter_switch  # a CPU engine leaves the interval alone
    finally:
        rag.close()
