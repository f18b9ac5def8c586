"""The packaged SmolLM2-135M-Instruct, converted from GGUF once per session, end to end."""

from __future__ import annotations

import pytest

from generation import SamplingParams, loader
from generation.loader import MARKER_NAME, resolve_model_dir

pytestmark = pytest.mark.slow

QUESTION = (
    "Context: The freezer in room 204 is kept at -80 C.\nQuestion: What temperature is the freezer in room 204 kept at?"
)


def test_answers_from_the_context(smollm2):
    out = smollm2.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=32))
    assert "80" in out.text
    assert out.finish_reason == "stop"  # ended its turn with <|im_end|>, not by running out
    assert out.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in out.text


def test_conversion_is_cached(smollm2_dir, generator_cache, monkeypatch):
    weights = smollm2_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.stat().st_ino, (smollm2_dir / MARKER_NAME).read_text())
    conversions = []
    convert_into = loader._convert_into

    def counting_convert_into(gguf_path, out_dir):
        conversions.append(gguf_path)
        convert_into(gguf_path, out_dir)

    # convert_gguf dequantises through this function: resolving again must reuse the folder.
    monkeypatch.setattr(loader, "_convert_into", counting_convert_into)
    again = resolve_model_dir(None, generator_cache)
    assert again == smollm2_dir
    assert conversions == []
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino, (smollm2_dir / MARKER_NAME).read_text()) == before


def test_converted_tokenizer_keeps_chatml(smollm2):
    tokenizer = smollm2.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.eos_token_ids
    ids = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tokenizer.decode(ids)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_stream_matches_generate_and_plain_decode(smollm2):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = "The three primary colors are"
    out = smollm2.generate(prompt, params)[0]
    deltas = list(smollm2.stream(prompt, params))
    assert len(deltas) > 8
    assert "".join(deltas) == out.text
    assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_chat_takes_several_conversations(smollm2):
    convs = [[{"role": "user", "content": "Say hello."}], [{"role": "user", "content": QUESTION}]]
    outs = smollm2.chat(convs, SamplingParams(max_tokens=6))
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0].prompt_token_ids == smollm2.apply_chat_template(convs[0])
    assert all(o.num_output_tokens > 0 for o in outs)
