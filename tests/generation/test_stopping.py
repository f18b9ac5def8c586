"""When generation ends (EOS, stop ids, stop strings, max_tokens) and what text comes back."""

from __future__ import annotations

import json
import shutil

import pytest

from generation import LLM, SamplingParams
from rag.errors import GenerationError

PROMPT = [60, 61, 62, 63, 64, 65]


@pytest.fixture(scope="module")
def free_run(tiny_llm):
    """The unconstrained greedy run every stop test cuts short."""
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert len(set(out.token_ids)) > 3  # not a one-token loop, so the cuts below are meaningful
    return out


def test_max_tokens_finishes_with_length(tiny_llm, free_run):
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == free_run.token_ids[:7]
    assert out.num_output_tokens == 7


def test_stop_token_id_ends_generation_and_is_kept_in_ids_not_text(tiny_llm, free_run):
    stop_id = free_run.token_ids[5]
    cut = free_run.token_ids.index(stop_id)
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=40, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run.token_ids[: cut + 1]
    expected_text = tiny_llm.tokenizer.decode(free_run.token_ids[:cut])
    assert out.text == expected_text


def test_eos_from_generation_config_stops_unless_ignored(tiny_model_factory, free_run, tmp_path):
    src, _ = tiny_model_factory("default", tokenizer=True)
    folder = tmp_path / "with-eos"
    shutil.copytree(src, folder)
    eos = free_run.token_ids[4]
    cut = free_run.token_ids.index(eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = LLM(folder, device="cpu")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40))[0]
    assert (out.finish_reason, out.token_ids) == ("stop", free_run.token_ids[: cut + 1])
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert (ignored.finish_reason, ignored.token_ids) == ("length", free_run.token_ids)


def test_stop_string_truncates_text_before_it(tiny_llm, free_run):
    text = free_run.text
    stop = text[10:13]
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    # Generation ended at the token that completed the stop string, not at max_tokens.
    assert len(out.token_ids) < len(free_run.token_ids)
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]


def test_earliest_of_several_stop_strings_wins(tiny_llm, free_run):
    text = free_run.text
    late, early = text[20:23], text[8:10]
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=40, stop=[late, early], ignore_eos=True))[0]
    assert out.text == text[: min(text.index(early), text.index(late))]


def test_stop_strings_need_a_tokenizer(tiny_model_factory):
    llm = LLM(tiny_model_factory("default")[0], device="cpu")
    assert llm.tokenizer is None
    with pytest.raises(GenerationError, match="tokenizer"):
        llm.generate([PROMPT], SamplingParams(stop=["x"]))
    with pytest.raises(GenerationError, match="tokenizer"):
        llm.generate("text prompt")


def test_bad_requests_raise_generation_error(tiny_llm):
    with pytest.raises(GenerationError, match="empty"):
        tiny_llm.generate([[]])
    with pytest.raises(GenerationError, match="token ids must be in"):
        tiny_llm.generate([[5, 100000]])
    with pytest.raises(GenerationError, match="context"):
        tiny_llm.generate([[5] * 256])
    with pytest.raises(GenerationError, match="2 SamplingParams for 1 prompts"):
        tiny_llm.generate([[5]], [SamplingParams(), SamplingParams()])


def test_output_is_capped_by_the_context_length(tiny_llm):
    out = tiny_llm.generate([[5] * 250], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert (out.finish_reason, out.num_output_tokens) == ("length", 6)


def test_stream_concatenates_to_generate_text(tiny_llm, free_run):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    deltas = list(tiny_llm.stream(PROMPT, params))
    assert len(deltas) > 5  # really incremental
    assert "".join(deltas) == free_run.text
    assert any(len(c.encode()) > 1 for c in free_run.text)  # multi-byte characters took part


def test_stream_never_yields_any_part_of_a_stop_string(tiny_llm, free_run):
    text = free_run.text
    stop = text[10:14]
    params = SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True)
    deltas = list(tiny_llm.stream(PROMPT, params))
    joined = "".join(deltas)
    assert joined == text[: text.index(stop)]
    assert joined == tiny_llm.generate([PROMPT], params)[0].text


def test_stream_releases_a_held_back_prefix_that_does_not_complete(tiny_llm, free_run):
    # The text contains the first 4 characters of this stop string but never the whole of it:
    # those characters are held back while they might start it, and must come out after all.
    stop = free_run.text[18:22] + "~~~"
    assert stop not in free_run.text
    params = SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True)
    assert "".join(tiny_llm.stream(PROMPT, params)) == free_run.text


def test_string_prompts_are_tokenized(tiny_llm):
    out = tiny_llm.generate("héllo 😀", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == tiny_llm.tokenizer("héllo 😀").input_ids
    assert out.num_prompt_tokens == 7  # one token per character
    assert out.num_output_tokens == 3 and len(out.text) == 3
