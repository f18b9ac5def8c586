"""The block-aligned prompt layout: a chunk's ids are the same at every position, on block boundaries.

A real Hugging Face tokenizer (one token per character, with a chat template) and the real
pipeline namespaces (`Rag.cache_segments`); no model runs here.
"""

from __future__ import annotations

import re

import pytest

from generation.engine.cache_namespaces import CacheNamespaces
from permissions.models import Principal
from rag.generator import SHARED_NAMESPACE, CacheSegment, GenerationRequest
from rag.pipeline import Rag, acl_namespace
from rag.prompt_layout import lay_out, pad_token_id
from rag.prompts import build_prompt
from rag.settings import load_settings
from rag.types import Hit
from tests.rag.tiny_engine import build_tiny_chat_model

BS = 8
ALICE = Principal("alice", frozenset({"genomics"}))


def hit(key: str, text: str, acl: str = "group:genomics", score: float = 1.0) -> Hit:
    return Hit(chunk_id=hash(key) % 10_000, document_key=key, source=f"/d/{key}", chunk_index=0, text=text,
               score=score, title=key, acl=frozenset({acl}))


X = hit("x.md", "Partition gpu holds nodes gpu01 to gpu08.")
Y = hit("y.md", "Scratch is purged after 30 days.", acl="public")
Z = hit("z.md", "The genomics share is /data/genomics.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))))


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    r = Rag(load_settings(home=tmp_path_factory.mktemp("home")))
    yield r
    r.close()


def request(rag: Rag, question: str, sources: list[Hit], history=(), principal: Principal = ALICE):
    prompt = build_prompt(question, sources, history)
    return GenerationRequest(prompt.messages, segments=rag.cache_segments(prompt, sources, principal),
                             user_salt=rag.user_salt(principal))


def layout(rag, tokenizer, question, sources, history=(), principal=ALICE, pad=True):
    req = request(rag, question, sources, history, principal)
    out = lay_out(req, tokenizer, BS, pad_token_id(tokenizer) if pad else None)
    assert out is not None
    return req, out


def test_a_chunk_has_the_same_ids_wherever_it_lands_and_fills_whole_blocks(rag, tokenizer):
    _, first = layout(rag, tokenizer, "Which nodes?", [X, Y, Z])
    _, second = layout(rag, tokenizer, "Where is the share, and how long does scratch last?", [Z, X],
                       history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}])

    def ids_of(out, i):
        start, end = out.chunk_spans[i]
        assert start % BS == 0 and end % BS == 0  # the chunk's blocks hold nothing else
        return out.token_ids[start:end]

    assert ids_of(first, 0) == ids_of(second, 1)  # X: position 1 of 3, then position 2 of 2
    assert ids_of(first, 2) == ids_of(second, 0)  # Z: third, then first (label [3], then [1])
    assert ids_of(first, 0) != ids_of(first, 1)
    # The chunk holds its title and text, not its citation number.
    start, end = first.chunk_spans[2]
    assert tokenizer.decode(first.token_ids[start:end]).strip() == "z.md\nThe genomics share is /data/genomics."
    assert tokenizer.decode(first.token_ids[first.chunk_spans[1][1]:start]).strip() == "[3]"


def test_the_model_reads_the_text_a_person_sees_with_blank_lines_added(rag, tokenizer):
    req, out = layout(rag, tokenizer, "Which nodes?", [X, Y])
    rendered = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    decoded = tokenizer.decode(out.token_ids)
    assert decoded != rendered  # padded
    assert re.sub(r"\n+", "\n", decoded) == re.sub(r"\n+", "\n", rendered)
    assert "[1] x.md\nPartition gpu" in rendered and "[2] y.md\nScratch" in rendered


def test_without_a_padding_token_the_pieces_are_joined_unpadded(rag, tokenizer):
    req, out = layout(rag, tokenizer, "Which nodes?", [X, Y], pad=False)
    rendered = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(out.token_ids) == rendered


def test_each_part_is_in_its_namespace_and_blocks_of_a_chunk_in_its_acl_only(rag, tokenizer):
    req, out = layout(rag, tokenizer, "Which nodes?", [X, Y])
    user = rag.user_salt(ALICE)
    genomics, public = acl_namespace(X.acl), acl_namespace(Y.acl)
    assert [ns for _, ns in out.regions] == [SHARED_NAMESPACE, genomics, public, user]
    namespaces = CacheNamespaces.of(out.regions, len(out.token_ids))
    for (start, end), ns in zip(out.chunk_spans, [genomics, public], strict=True):
        assert {namespaces.block_key(b, BS) for b in range(start // BS, end // BS)} == {ns}
    # Label 1 follows only the head and is shared with it: the first chunk's region starts at
    # the chunk. Label 2 is its source's (its region starts at the label's first token). The
    # user's part starts right after the last chunk, on a block boundary.
    assert out.regions[1][0] == out.chunk_spans[0][0]
    assert tokenizer.decode(out.token_ids[out.chunk_spans[0][0] - BS:out.chunk_spans[0][0]]).strip() == "[1]"
    label_start = out.regions[2][0]
    assert tokenizer.decode(out.token_ids[label_start:out.chunk_spans[1][0]]).strip() == "[2]"
    assert out.regions[-1][0] == out.chunk_spans[-1][1]
    assert tokenizer.decode(out.token_ids[out.regions[-1][0]:]).startswith("Question: Which nodes?")


def test_segments_that_are_not_parts_of_the_last_message_get_no_layout(rag, tokenizer):
    req = request(rag, "Which nodes?", [X])
    substrings = GenerationRequest(req.messages, segments=[CacheSegment("Question: Which nodes?", "user:u")])
    assert lay_out(substrings, tokenizer, BS, pad_token_id(tokenizer)) is None
    assert lay_out(GenerationRequest(req.messages), tokenizer, BS, pad_token_id(tokenizer)) is None


def test_a_chat_template_that_rewrites_the_content_gets_no_layout(rag, tokenizer):
    req = request(rag, "Which nodes?", [X])
    original = tokenizer.chat_template
    tokenizer.chat_template = original.replace("{{ m['content'] }}", "{{ m['content'] | replace('\n\n', '\n') }}")
    try:
        assert lay_out(req, tokenizer, BS, pad_token_id(tokenizer)) is None
    finally:
        tokenizer.chat_template = original


def test_the_pieces_are_an_engine_segmented_prompt_with_a_block_aligned_head(rag, tokenizer):
    from generation.engine.prompt_segments import PromptSegment, check_segments

    _, out = layout(rag, tokenizer, "Which nodes?", [X, Y])
    # The first label ends the head: the first chunk sits where its canonical copy head || chunk
    # does, so computing it there publishes that copy.
    assert [kind for kind, *_ in out.pieces] == ["head", "chunk", "label", "chunk", "suffix"]
    segments = [PromptSegment.of(kind, out.token_ids[start:end], ns) for kind, start, end, ns in out.pieces]
    check_segments(segments)
    assert [t for s in segments for t in s.token_ids] == out.token_ids
    assert tokenizer.decode(segments[0].token_ids[-BS:]).strip() == "[1]"
    # The engine's canonical copy of a chunk is head || chunk: the head fills whole blocks, and
    # each label is one block (pad, then "[n]").
    assert len(segments[0].token_ids) % BS == 0
    assert all(len(s.token_ids) == BS for s in segments if s.kind.value == "label")
    assert segments[0].namespace == SHARED_NAMESPACE and segments[-1].namespace == rag.user_salt(ALICE)
