"""Token batches for the embedder: tokenize a window of texts, sort by length, pack by a token budget."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TokenWindow:
    """The token ids of a window of texts, stored flat: text i is flat[starts[i] : starts[i] + lengths[i]]."""

    flat: np.ndarray  # (total tokens,) int64
    starts: np.ndarray  # (texts,) int64
    lengths: np.ndarray  # (texts,) int64, each >= 1


class TextEncoder:
    """Turns texts into truncated token ids with a model's tokenizer.

    A fast (Rust) tokenizer is used through its own copy of the backend: batch encoding there
    releases the GIL, so it runs beside the thread that drives the GPU, and the copy's truncation
    setting cannot leak into the shared tokenizer that the chunker counts tokens with.
    """

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.max_length = max_length
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._hf = tokenizer
        self._backend = None
        if backend is not None:
            from tokenizers import Tokenizer

            own = Tokenizer.from_str(backend.to_str())
            own.no_padding()
            own.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))
            self._backend = own
        # Padding positions are masked out, so any id works; the tokenizer's own keeps logs readable.
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        # A tokenizer without special tokens turns "" into no tokens, but the model needs one position.
        unk = getattr(tokenizer, "unk_token_id", None)
        self._filler_id = int(unk) if unk is not None else self.pad_id

    def encode(self, texts: Sequence[str]) -> TokenWindow:
        """Tokenize texts (with the model's special tokens), cut to max_length."""
        if self._backend is not None:
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)  # no offsets: faster
            ids = [e.ids for e in encode(list(texts))]
        else:  # a slow (Python) tokenizer: same ids, without the overlap
            ids = self._hf(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        ids = [row if row else [self._filler_id] for row in ids]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        starts = np.zeros(len(ids), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        return TokenWindow(flat, starts, lengths)


def plan_batches(lengths: np.ndarray, max_batch_tokens: int) -> list[np.ndarray]:
    """Group texts into batches of similar length, longest first.

    Each batch holds as many texts as fit in max_batch_tokens padded tokens (rows × its longest
    text), so short texts go in big batches; a text longer than the budget gets a batch of its own.
    Longest first: a batch too big for the device fails at once, not at the end of a run.

    Returns:
        The indices (into lengths) of each batch, each sorted by decreasing length.
    """
    order = np.argsort(-lengths, kind="stable")
    batches = []
    start = 0
    while start < len(order):
        rows = max(1, max_batch_tokens // int(lengths[order[start]]))
        batches.append(order[start : start + rows])
        start += rows
    return batches


def pad_rows(window: TokenWindow, idx: np.ndarray, pad_id: int, out: np.ndarray) -> None:
    """Write the ids of texts idx (longest first) into out (len(idx), longest), right-padded with pad_id."""
    lengths = window.lengths[idx]
    cols = np.arange(out.shape[1])
    # Gather every (row, column) at once; positions past a text's end read a neighbour, then get padded.
    np.take(window.flat, window.starts[idx, None] + cols, out=out, mode="clip")
    out[cols >= lengths[:, None]] = pad_id
