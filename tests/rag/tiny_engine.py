"""A tiny random Llama with a one-character-per-token tokenizer and a chat template, for LocalGenerator tests.

It is a real model folder run by the real engine (CPU, fp32, milliseconds per step); only its
weights are random. The context is 1,024 tokens so that prompts with the real system prompt fit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rag.generator import GenerationDone, GenerationRequest
from rag.generators.local import LocalGenerator
from rag.pipeline import Rag
from rag.settings import load_settings
from tests.generation.conftest import save_char_tokenizer, tiny_hf_config

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>\n{% endif %}"
)


def build_tiny_chat_model(path: Path) -> Path:
    """Save the tiny model and its tokenizer (with CHAT_TEMPLATE) to `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_hf_config("default")
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(str(path))
    save_char_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def local_generator(model_dir: Path, block_size: int = 8, **engine_args) -> LocalGenerator:
    """A LocalGenerator over a fresh engine (an empty prefix cache) on the CPU."""
    from generation.config import EngineConfig
    from generation.engine.async_engine import AsyncLLMEngine
    from generation.engine.llm_engine import LLMEngine

    config = EngineConfig(device="cpu", dtype="float32", block_size=block_size, **engine_args)
    return LocalGenerator(engine=AsyncLLMEngine(LLMEngine(model_dir, config)))


def generate(generator: LocalGenerator, request: GenerationRequest) -> GenerationDone:
    """Run one request to the end; its GenerationDone."""

    async def run() -> GenerationDone:
        events = [event async for event in generator.stream(request)]
        assert isinstance(events[-1], GenerationDone)
        return events[-1]

    return asyncio.run(run())


def hit_tokens(generator: LocalGenerator) -> int:
    """Prompt tokens the engine has served from its prefix cache so far (its own counter)."""
    return generator.metrics().prefix_cache_hit_tokens


# Fixtures of the tests that drive the tiny engine through the service's prompt code
# (test_kv_isolation, test_source_order, test_layout_chunk_reuse): import them by name.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    r = Rag(load_settings(home=tmp_path_factory.mktemp("home")))
    yield r
    r.close()


@pytest.fixture
def generator(model_dir):
    gen = local_generator(model_dir, block_size=8, num_kv_blocks=512)
    yield gen
    gen.engine.shutdown()
