"""One encoder on one device: pipelined tokenization, length-sorted token-budget batches, fp32 pooling."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ingest.embed.batches import TextEncoder, TokenWindow, pad_rows, plan_batches
from ingest.embed.prefetch import prefetch
from rag.forward_memo import batch_key, memo_folder, memoized, model_fingerprint
from rag.quiet import quiet_libraries

# The first window is small so the device starts early; later ones are big enough that sorting
# inside a window leaves almost no padding.
FIRST_WINDOW_TEXTS = 512
WINDOW_TEXTS = 4096
# Ready batches waiting for the device: enough to ride out a slow window, few enough to bound
# pinned memory.
PREFETCH_BATCHES = 4
# Pooled vectors go back to the host this often, so device memory does not grow with the input.
FLUSH_ROWS = 65536


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a process needs to build a runner (picklable, for worker processes)."""

    folder: str
    device: str
    dtype: str  # a torch dtype name: "float32", "bfloat16", "float16"
    pooling: str  # "mean", "cls", "max" or "lasttoken"
    max_length: int
    max_batch_tokens: int


@dataclass(frozen=True)
class HostBatch:
    """One forward pass worth of texts, ready to copy to the device."""

    positions: np.ndarray  # (b,) rows of the output these texts fill
    ids: torch.Tensor  # (b, longest) int64, right-padded; pinned when the device is a GPU
    lengths: torch.Tensor  # (b,) int64
    uniform: bool  # every text has the same length: no attention mask needed


def load_encoder(folder: str | Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Load a Hugging Face encoder for inference, with PyTorch SDPA attention where the model has it."""
    from transformers import AutoModel

    with quiet_libraries():  # also in GPU worker processes, whose stderr is the user's
        try:
            model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")
        except (ValueError, ImportError):  # an architecture without an SDPA path: its default attention
            model = AutoModel.from_pretrained(folder, local_files_only=True)
    return model.to(device=device, dtype=dtype).eval()


def pool(hidden: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool token states into L2-normalized fp32 vectors (in fp32 whatever the model's dtype).

    Args:
        hidden: (b, seq, dim) last hidden states.
        valid: (b, seq) bool, True on real (non-padding) tokens; padding is on the right.
        lengths: (b,) real tokens per row.
        mode: "mean", "cls", "max" or "lasttoken".

    Returns:
        (b, dim) float32, unit rows.
    """
    if mode == "mean":
        pooled = (hidden.float() * valid.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1)
    elif mode == "cls":
        pooled = hidden[:, 0].float()
    elif mode == "max":
        pooled = hidden.float().masked_fill(~valid.unsqueeze(-1), float("-inf")).max(1).values
    else:  # lasttoken: padding is on the right, so the last real token sits at length - 1
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1].float()
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


class EncoderRunner:
    """Embeds texts with one model on one device.

    Tokenization runs one window ahead in a background thread and batch assembly in another,
    while this thread only launches the forward passes; on a GPU nothing waits for the device
    until the vectors are copied back. Batches are sorted by token length and sized by a token
    budget, so little padding is computed and short texts share big batches.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: str, pooling: str, max_length: int,
                 max_batch_tokens: int) -> None:
        self.model = model
        self.device = torch.device(device)
        self.pooling = pooling
        self.encoder = TextEncoder(tokenizer, max_length)
        self.max_batch_tokens = max_batch_tokens
        self.dim = int(model.config.hidden_size)
        self.window_texts = WINDOW_TEXTS
        self.first_window_texts = FIRST_WINDOW_TEXTS
        self._pin = self.device.type == "cuda"
        self.uses_prepared_mask = self._prepared_mask_works()
        self._fingerprint: str | None = None  # of the model, for the test suite's memo (rag.forward_memo)

    @classmethod
    def from_spec(cls, spec: RunnerSpec) -> EncoderRunner:
        """Load the model and tokenizer a spec names (in a worker process)."""
        from transformers import AutoTokenizer

        with quiet_libraries():
            tokenizer = AutoTokenizer.from_pretrained(spec.folder, local_files_only=True)
        model = load_encoder(spec.folder, spec.device, getattr(torch, spec.dtype))
        return cls(model, tokenizer, spec.device, spec.pooling, spec.max_length, spec.max_batch_tokens)

    def run(self, texts: Sequence[str], progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Embed texts; returns float32 (len(texts), dim) unit rows in the order of texts.

        Args:
            texts: the texts; anything past max_length tokens is truncated.
            progress: called with the number of texts handed to the device after each batch.
        """
        texts = list(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        batches: Iterator[HostBatch] = self._host_batches(texts)
        if len(texts) > 1:  # a single query is faster without a thread hand-off
            batches = prefetch(batches, PREFETCH_BATCHES)
        done: list[tuple[np.ndarray, torch.Tensor]] = []  # (positions, vectors on the host)
        rows: list[tuple[np.ndarray, torch.Tensor]] = []  # (positions, vectors still on the device)
        num_rows = 0
        with torch.inference_mode():
            for batch in batches:
                rows.append((batch.positions, self._forward(batch)))
                num_rows += len(batch.positions)
                if progress is not None:
                    progress(len(batch.positions))
                if num_rows >= FLUSH_ROWS:
                    done.append(self._to_host(rows))
                    rows, num_rows = [], 0
            if rows:
                done.append(self._to_host(rows))
        if self._pin:
            torch.cuda.synchronize(self.device)  # the copies to pinned memory were asynchronous
        for positions, vectors in done:
            out[positions] = vectors.numpy()
        return out

    def _windows(self, num_texts: int) -> list[tuple[int, int]]:
        spans = [(0, min(num_texts, self.first_window_texts))]
        while spans[-1][1] < num_texts:
            lo = spans[-1][1]
            spans.append((lo, min(num_texts, lo + self.window_texts)))
        return spans

    def _host_batches(self, texts: list[str]) -> Iterator[HostBatch]:
        spans = self._windows(len(texts))
        windows: Iterator[TokenWindow] = (self.encoder.encode(texts[lo:hi]) for lo, hi in spans)
        if len(spans) > 1:  # tokenize the next window while this one's batches run
            windows = prefetch(windows, 1)
        for (lo, _), window in zip(spans, windows, strict=True):
            for idx in plan_batches(window.lengths, self.max_batch_tokens):
                lengths = window.lengths[idx]
                longest = int(lengths[0])
                ids = torch.empty((len(idx), longest), dtype=torch.int64, pin_memory=self._pin)
                pad_rows(window, idx, self.encoder.pad_id, ids.numpy())
                lengths_t = torch.from_numpy(lengths)
                yield HostBatch(lo + idx, ids, lengths_t.pin_memory() if self._pin else lengths_t,
                                bool(lengths[-1] == longest))

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        folder = memo_folder() if self.device.type == "cpu" else None
        if folder is None:
            return self._compute(batch)
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        settings = f"encoder|{self.pooling}|{batch.uniform}|{self.uses_prepared_mask}"
        key = batch_key(self._fingerprint, settings, [batch.ids.numpy(), batch.lengths.numpy()])
        return torch.from_numpy(memoized(folder, key, lambda: self._compute(batch).numpy()))

    def _compute(self, batch: HostBatch) -> torch.Tensor:
        ids = batch.ids.to(self.device, non_blocking=True)
        lengths = batch.lengths.to(self.device, non_blocking=True)
        valid = torch.arange(ids.shape[1], device=self.device) < lengths.unsqueeze(1)  # (b, seq)
        # No mask at all when no row is padded: SDPA can then take its flash kernel.
        mask = None if batch.uniform else self._attention_mask(valid)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return pool(hidden, valid, lengths, self.pooling)

    def _attention_mask(self, valid: torch.Tensor, prepared: bool | None = None) -> torch.Tensor:
        if not (self.uses_prepared_mask if prepared is None else prepared):
            return valid.long()
        # A ready 4D mask goes to attention as is. Given a 2D mask, transformers first checks
        # `mask.all()` on the device, a sync per batch that stalls the launch pipeline. Shaped
        # (b, 1, 1, seq) and broadcast over queries: SDPA then pads and copies b × seq values,
        # not the b × seq × seq of an expanded mask.
        mask = valid[:, None, None, :]
        if getattr(self.model.config, "_attn_implementation", "") == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype  # eager attention adds the mask to its scores
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    def _to_host(self, rows: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, torch.Tensor]:
        positions = np.concatenate([p for p, _ in rows])
        vectors = torch.cat([v for _, v in rows])
        if not self._pin:
            return positions, vectors
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        return positions, host

    def _prepared_mask_works(self) -> bool:
        """Whether this model takes a ready 4D padding mask and gives what a 2D mask gives.

        Not every architecture does: one that builds its own causal mask would lose it, one that
        predates transformers' mask helpers may reject a 4D mask. Checked once on a padded pair.
        """
        window = self.encoder.encode(["a short text", "a somewhat longer text with more words in it"])
        idx = plan_batches(window.lengths, 1 << 30)[0]
        ids = torch.empty((2, int(window.lengths[idx[0]])), dtype=torch.int64)
        pad_rows(window, idx, self.encoder.pad_id, ids.numpy())
        ids = ids.to(self.device)
        lengths = torch.from_numpy(window.lengths[idx]).to(self.device)
        valid = torch.arange(ids.shape[1], device=self.device) < lengths.unsqueeze(1)
        outputs = []
        try:
            with torch.inference_mode():
                for prepared in (False, True):
                    mask = self._attention_mask(valid, prepared)
                    hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                    outputs.append(pool(hidden, valid, lengths, self.pooling))
        except Exception:  # any failure of the 4D form means: use the 2D one
            return False
        # A lost causal mask or a misread mask moves vectors far more than rounding does.
        return bool(((outputs[0] * outputs[1]).sum(1) >= 0.999).all())
