"""PrefillGraphs: small prefill steps (few sequences, few tokens) captured as CUDA graphs at bucketed token counts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from generation.layers.attention import AttentionMetadata, KVCache
from generation.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# A prompt of a few hundred tokens over a cached prefix (a RAG question after its cached
# documents) costs the GPU a pass over the weights, ~5 ms for an 8B model, but launching its
# ~350 kernels one by one from Python costs ~14 ms: such steps are worth a graph. Larger steps
# are bound by their matmuls, and eager launches keep up with them.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_SEQS = 8


@dataclass(frozen=True)
class PrefillLayout:
    """Offsets of the fields in the packed int64 buffer (token fields sized for the largest bucket)."""

    max_tokens: int
    max_seqs: int
    max_blocks: int

    @property
    def ids(self) -> slice:
        return slice(0, self.max_tokens)

    @property
    def positions(self) -> slice:
        return slice(self.max_tokens, 2 * self.max_tokens)

    @property
    def slots(self) -> slice:
        return slice(2 * self.max_tokens, 3 * self.max_tokens)

    @property
    def logits_indices(self) -> slice:
        start = 3 * self.max_tokens
        return slice(start, start + self.max_seqs)

    @property
    def cu_seqlens(self) -> slice:
        start = 3 * self.max_tokens + self.max_seqs
        return slice(start, start + self.max_seqs + 1)

    @property
    def context_lens(self) -> slice:
        start = 3 * self.max_tokens + 2 * self.max_seqs + 1
        return slice(start, start + self.max_seqs)

    @property
    def block_tables(self) -> slice:
        start = 3 * self.max_tokens + 3 * self.max_seqs + 1
        return slice(start, start + self.max_seqs * self.max_blocks)

    @property
    def numel(self) -> int:
        return self.block_tables.stop


class PrefillGraphs:
    """One CUDA graph of `model`'s prefill step and LM head per token bucket, for up to MAX_SEQS sequences.

    A step of T tokens over S sequences (S <= MAX_SEQS, T <= the largest bucket) replays the
    smallest bucket >= T. Its inputs are packed on the host into one buffer and sent with one copy.
    Padding tokens store nothing (slot -1) and belong to no sequence (past the last cu_seqlens
    boundary), so the attention kernel skips them; padding sequences have no tokens and context 0.
    Every sequence, one-token decodes included, goes through the prefill attention kernel, whose
    launch grid depends only on the bucket and MAX_SEQS.

    Args:
        model: the model; its weights and the KV cache must stay where they are for the graphs' life.
        kv_caches: one KVCache per layer (its FP8 scales, if any, are read by pointer at each replay).
        max_blocks: block-table width of a max_model_len sequence.
        pool: a CUDA graph memory pool to share (the decode graphs'), or None.
    """

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_blocks: int, pool: tuple[int, int] | None
    ) -> None:
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        assert device.type == "cuda", "CUDA graphs need a CUDA model"
        self.buckets = TOKEN_BUCKETS
        self.layout = layout = PrefillLayout(self.buckets[-1], MAX_SEQS, max_blocks)
        # Normal tensors even when built under inference mode: `write` updates them in place,
        # and may be called outside it (as DecodeInputs' buffers may).
        with torch.inference_mode(False):
            self.host = torch.zeros(layout.numel, dtype=torch.int64, pin_memory=True)
            self.device_buffer = torch.zeros(layout.numel, dtype=torch.int64, device=device)
        self._host_np = self.host.numpy()
        self._copied = torch.cuda.Event()
        # The kernels' int32 views of the packed fields, filled inside each replay.
        self.cu_seqlens = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(MAX_SEQS, dtype=torch.int32, device=device)
        self.block_tables = torch.full((MAX_SEQS, max_blocks), -1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(MAX_SEQS, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._write_padding()
        started = time.perf_counter()
        for tokens in reversed(self.buckets):  # largest first: it sizes the pool
            self._step(model, kv_caches, tokens)  # warm-up outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(model, kv_caches, tokens)
            pool = graph.pool() if pool is None else pool
            self.graphs[tokens] = graph
            torch.cuda.synchronize(device)
        logger.info("captured %d prefill CUDA graphs (up to %d tokens, %d sequences) in %.1f s", len(self.buckets),
                    self.buckets[-1], MAX_SEQS, time.perf_counter() - started)  # fmt: skip

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.buckets[-1] and num_seqs <= MAX_SEQS

    def write(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        cu_seqlens: list[int],
        context_lens: list[int],
        tables: np.ndarray,
        logits_indices: list[int],
    ) -> AttentionMetadata:
        """Pack a step's inputs (cu_seqlens over all its sequences) and copy them; returns its metadata.

        The metadata's tensors are filled by the replay: valid once `replay` has been called.
        """
        layout, buf = self.layout, self._host_np
        num_tokens, num_seqs = len(input_ids), len(cu_seqlens) - 1
        assert self.fits(num_tokens, num_seqs) and tables.shape[1] <= layout.max_blocks
        self._copied.synchronize()  # the previous copy has read the host buffer
        buf[:] = 0
        buf[layout.slots] = -1
        buf[layout.block_tables] = -1
        buf[layout.ids.start : layout.ids.start + num_tokens] = input_ids
        buf[layout.positions.start : layout.positions.start + num_tokens] = positions
        buf[layout.slots.start : layout.slots.start + num_tokens] = slots
        buf[layout.logits_indices.start : layout.logits_indices.start + len(logits_indices)] = logits_indices
        cu = buf[layout.cu_seqlens]
        cu[: num_seqs + 1] = cu_seqlens
        cu[num_seqs + 1 :] = cu_seqlens[-1]  # padding sequences: no tokens
        buf[layout.context_lens.start : layout.context_lens.start + num_seqs] = context_lens
        grid = buf[layout.block_tables].reshape(layout.max_seqs, layout.max_blocks)
        grid[:num_seqs, : tables.shape[1]] = tables
        self.device_buffer.copy_(self.host, non_blocking=True)
        self._copied.record()
        return AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._field(layout.slots)[:num_tokens],
            context_lens=self.context_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            cu_seqlens_q=self.cu_seqlens[: num_seqs + 1],
        )

    def input_ids(self, num_tokens: int) -> torch.Tensor:
        return self._field(self.layout.ids)[:num_tokens]

    def positions(self, num_tokens: int) -> torch.Tensor:
        return self._field(self.layout.positions)[:num_tokens]

    def logits_indices(self, n: int) -> torch.Tensor:
        return self._field(self.layout.logits_indices)[:n]

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def replay(self, num_tokens: int, num_logits: int) -> torch.Tensor:
        """Run the step written last; logits [num_logits, V], a view of a static buffer (read before the next)."""
        self.graphs[self.bucket(num_tokens)].replay()
        return self.logits[:num_logits]

    def _field(self, part: slice) -> torch.Tensor:
        return self.device_buffer[part]

    def _write_padding(self) -> None:
        buf = self._host_np
        buf[:] = 0
        buf[self.layout.slots] = -1
        buf[self.layout.block_tables] = -1
        self.device_buffer.copy_(self.host)

    def _step(self, model: LlamaForCausalLM, kv_caches: list[KVCache], tokens: int) -> None:
        layout = self.layout
        self.cu_seqlens.copy_(self._field(layout.cu_seqlens))
        self.context_lens.copy_(self._field(layout.context_lens))
        self.block_tables.copy_(self._field(layout.block_tables).view(layout.max_seqs, layout.max_blocks))
        meta = AttentionMetadata(True, self._field(layout.slots)[:tokens], self.context_lens, self.block_tables,
                                 self.cu_seqlens)  # fmt: skip
        hidden = model(self._field(layout.ids)[:tokens], self._field(layout.positions)[:tokens], meta, kv_caches)
        model.compute_logits(hidden[self._field(layout.logits_indices)], out=self.logits)
