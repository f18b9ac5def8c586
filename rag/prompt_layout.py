"""Block-aligned prompt token ids for the local engine: a chunk's ids are the same in every prompt.

With B the engine's KV block size, a RAG prompt becomes

    [template head + "Sources:" pad ...]    shared namespace; ends on a block boundary
    [pad ... "[1]"]                         label 1, shared too: one block, the head's last
    [" title\ntext\n\n" pad ...]           chunk 1, its ACL namespace; ends on a boundary
    [pad ... "[2]"] [chunk 2 pad ...] ...   one label (its source's ACL namespace) and one
                                            chunk per source
    [history, question, template tail]      the user's namespace, unpadded

Each piece is tokenized on its own and the ids are concatenated, so a chunk's ids depend only
on its title and text, never on what comes before it or on its citation number (the label is a
piece of its own). Every chunk starts and ends on a KV block boundary: its blocks hold nothing
but the chunk, which is what lets the engine reuse them (exactly, in the same prefix, or at
another position: the engine's canonical copy of a chunk is `head ‖ chunk`, so the head is
padded to a boundary too). A label in the head's namespace right after the head (the pipeline
shares label 1) is laid out as the head's last block: then the first source of every prompt
sits exactly where a chunk's canonical copy does, and computing it publishes that copy.

Padding is a token that renders as a newline (else a space), so the text the model reads is
the text a person sees with some blank lines added; remote generators get that text without
padding (they are sent messages, not ids).

A request whose segments are not parts of its last message, a chat template that does not keep
the content verbatim, or a tokenizer without a one-token newline or space falls back to
tokenizing the rendered prompt whole (`LocalGenerator.prompt`), or to no padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rag.generator import GenerationRequest

Encode = Callable[[str], Sequence[int]]
# Placed where the last message's content goes, to find the chat template's text around it.
_CONTENT_MARK = "\u2063rag-content\u2063"
PAD_CANDIDATES = ("\n", " ")


@dataclass(frozen=True)
class PromptLayout:
    """A prompt's token ids and where its namespaces and chunks lie.

    Attributes:
        token_ids: the prompt.
        regions: `(token offset, namespace)` transitions, the first at 0 (the engine's regions).
        chunk_spans: `(start, end)` token offsets of each chunk segment, padding included, in
            prompt order; both on KV block boundaries when the layout is padded.
        pieces: `(kind, start, end, namespace)` of each piece in order: one "head" (the chat
            template's head, the head part and a shared first label), "label"s and "chunk"s, one "suffix" (the
            user's part and the template's tail), the shape of the engine's segmented prompts.
    """

    token_ids: list[int]
    regions: list[tuple[int, str | None]]
    chunk_spans: tuple[tuple[int, int], ...]
    pieces: tuple[tuple[str, int, int, str | None], ...] = ()

    @property
    def chunk_ends(self) -> tuple[int, ...]:
        return tuple(end for _, end in self.chunk_spans)


def pad_token_id(tokenizer: Any) -> int | None:
    """A token that is exactly a newline (else a space) on its own, or None when the vocabulary has neither."""
    for text in PAD_CANDIDATES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == text:
            return int(ids[0])
    return None


def template_around_content(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, str] | None:
    """The rendered chat template's text before and after the last message's content.

    None when the template does not render that content verbatim (it trims or rewrites it), so
    that tokenizing the pieces apart would not reproduce the prompt.
    """
    if not messages:
        return None
    marked = [*messages[:-1], {**messages[-1], "content": _CONTENT_MARK}]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    if rendered.count(_CONTENT_MARK) != 1:
        return None
    head, tail = rendered.split(_CONTENT_MARK)
    real = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    if real != head + messages[-1]["content"] + tail:
        return None
    return head, tail


def lay_out(request: GenerationRequest, tokenizer: Any, block_size: int, pad_id: int | None,
            encode: Encode | None = None) -> PromptLayout | None:
    """The block-aligned ids and namespace regions of a request whose segments are parts of its last message.

    Args:
        block_size: the engine's KV block size (tokens).
        pad_id: the padding token (`pad_token_id`); None lays the pieces out without padding.
        encode: text -> ids without special tokens added (a cache in front of the tokenizer);
            the tokenizer's own encode when None.

    Returns:
        None when the segments do not concatenate to the last message's content, or the chat
        template does not keep it verbatim: the caller then tokenizes the rendered prompt whole.
    """
    segments = request.segments
    messages = request.messages
    if not segments or not messages or "".join(s.text for s in segments) != messages[-1].get("content"):
        return None
    around = template_around_content(tokenizer, messages)
    if around is None:
        return None
    head, tail = around
    if encode is None:
        def encode(text: str) -> Sequence[int]:
            return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = list(encode(head))
    regions: list[tuple[int, str | None]] = [(0, request.base_namespace)]
    chunk_spans: list[tuple[int, int]] = []
    pieces: list[tuple[str, int, int, str | None]] = [("head", 0, len(ids), request.base_namespace)] if ids else []
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        piece = list(encode(segment.text + tail if i == last else segment.text))
        followed_by_label = i < last and segments[i + 1].kind == "label"
        if pad_id is not None and segment.kind == "label":
            # Pad before the label so that the chunk after it starts on a block boundary.
            piece = [pad_id] * (-(len(ids) + len(piece)) % block_size) + piece
        elif pad_id is not None and i != last and (segment.kind == "chunk" or followed_by_label):
            # Pad after a chunk, and after the head, so that what follows starts on a boundary
            # (never after the last part: the template's tail must end the prompt).
            piece = piece + [pad_id] * (-(len(ids) + len(piece)) % block_size)
        if not piece:
            continue
        _add_region(regions, len(ids), segment.namespace)
        kind = segment.kind if segment.kind != "text" else ("suffix" if i == last else "head")
        if kind == "label" and pieces and pieces[-1][0] == "head" and pieces[-1][3] == segment.namespace:
            kind = "head"  # a shared label right after the head ends the head (see the module's doc)
        if kind == "head" and pieces and pieces[-1][0] == "head" and pieces[-1][3] == segment.namespace:
            # The chat template's head and the shared head part are one piece.
            pieces[-1] = ("head", pieces[-1][1], len(ids) + len(piece), segment.namespace)
        else:
            pieces.append((kind, len(ids), len(ids) + len(piece), segment.namespace))
        if segment.kind == "chunk":
            chunk_spans.append((len(ids), len(ids) + len(piece)))
        ids.extend(piece)
    return PromptLayout(ids, regions, tuple(chunk_spans), tuple(pieces))


def _add_region(regions: list[tuple[int, str | None]], offset: int, namespace: str) -> None:
    if regions[-1][1] == namespace:
        return
    if regions[-1][0] == offset:  # the region before holds no token (its piece was empty)
        regions.pop()
        if regions and regions[-1][1] == namespace:
            return
    regions.append((offset, namespace))
