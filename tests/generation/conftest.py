"""Fixtures for generator tests: tiny random Llama-family folders and the packaged SmolLM2, converted once."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Characters of the tiny models' tokenizer, one token each: ASCII plus multi-byte characters,
# so that random generation produces readable text with 2-, 3- and 4-byte UTF-8 characters.
TINY_CHARS = [chr(c) for c in range(32, 127)] + list("\néöüçßñÄÖÜαβλπΩ—→✓€£©°±中文日本한😀🚀")
TINY_SPECIALS = ["<s>", "</s>", "<unk>"]
TINY_VOCAB = len(TINY_SPECIALS) + len(TINY_CHARS)
assert TINY_VOCAB == 128
# The "mistral_window" variant's sliding window, in tokens.
MISTRAL_WINDOW = 32


def tiny_hf_config(variant: str = "default"):
    """A 2-layer GQA config (4 query heads, 2 KV heads); `variant` switches one feature on."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Larger than the default 0.02 so logits spread out and greedy picks are not near-ties.
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=variant == "tied",
    )
    if variant == "qwen2":
        return Qwen2Config(**common)
    if variant == "qwen3":
        # Qwen3 sets head_dim on its own (128 by default); QK-norm is what this variant tests.
        return Qwen3Config(**common, head_dim=16)
    if variant == "mistral":
        # Mistral v0.3: full attention (sliding_window None); head_dim set apart from
        # hidden_size / num_attention_heads (32, not 16), as Mistral Nemo does.
        return MistralConfig(**common, head_dim=32, sliding_window=None)
    if variant == "mistral_window":
        # Mistral v0.1: a sliding window shorter than max_position_embeddings (256).
        return MistralConfig(**common, sliding_window=MISTRAL_WINDOW)
    rope_scaling = None
    if variant == "llama3":
        # original_max_position_embeddings small enough that the frequencies fall in all three
        # bands (scaled, smoothed, kept) for head_dim 16.
        rope_scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
    elif variant == "linear":
        rope_scaling = dict(rope_type="linear", factor=4.0)
    return LlamaConfig(
        **common,
        rope_scaling=rope_scaling,
        rope_theta=10000.0,
        attention_bias=variant == "attention_bias",
    )


def build_tiny_model(path: Path, variant: str = "default", seed: int = 0):
    """Save a random-weight HF model to `path` (safetensors) and return it in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(variant)).eval()
    model.save_pretrained(str(path))
    return model


def save_char_tokenizer(path: Path) -> None:
    """One token per character of TINY_CHARS; <s>=0, </s>=1, <unk>=2."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # concatenate the characters, no separators
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))


def byte_tokenizer():
    """A byte-level tokenizer without merges: one token per UTF-8 byte (no model needed).

    Multi-byte characters then span several tokens, which incremental detokenisation must
    get right.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Run generator tests on one intra-op thread, then restore the setting.

    Decoding is a chain of small ops (and memory-bound matmuls): with two threads on a busy
    2-core machine each op waits for a descheduled worker, which made these tests 3-10x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., tuple[Path, object]]:
    """(folder, HF model) for a variant, built once per session and variant."""
    built: dict[tuple[str, bool], tuple[Path, object]] = {}

    def make(variant: str = "default", tokenizer: bool = False) -> tuple[Path, object]:
        key = (variant, tokenizer)
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{variant}{'-tok' if tokenizer else ''}")
            model = build_tiny_model(path, variant)
            if tokenizer:
                save_char_tokenizer(path)
            built[key] = (path, model)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_factory):
    """Our LLM over the default tiny model with the character tokenizer."""
    from generation import LLM

    path, _ = tiny_model_factory("default", tokenizer=True)
    return LLM(path, device="cpu")


@pytest.fixture(scope="session")
def byte_tok():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def generator_cache(model_cache) -> Path:
    # The session-wide model cache (tests/conftest.py): one conversion for all tests.
    return model_cache


@pytest.fixture(scope="session")
def smollm2_dir(generator_cache) -> Path:
    """The packaged SmolLM2 GGUF converted once per session (about 20 s on 2 cores)."""
    from generation.loader import resolve_model_dir

    return resolve_model_dir(None, generator_cache)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from generation import LLM

    return LLM(smollm2_dir, device="cpu")
