"""Incremental detokenisation of multi-byte characters split across byte tokens."""

from __future__ import annotations

from generation.engine.detokenizer import IncrementalDetokenizer

TEXT = "héllo 😀 wörld — ünïcödé 日本"


def test_byte_tokens_stream_whole_characters(byte_tok):
    tokenizer = byte_tok
    ids = tokenizer(TEXT).input_ids
    assert len(ids) == len(TEXT.encode())  # one token per byte: characters span tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer("prompt ").input_ids)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # "😀" is 4 bytes: nothing comes out until its last byte arrives.
    assert "😀" in deltas


def test_flush_emits_an_incomplete_character(byte_tok):
    tokenizer = byte_tok
    ids = tokenizer("a😀").input_ids[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.add(t) for t in ids) == "a"
    assert detok.flush().startswith("\ufffd")
