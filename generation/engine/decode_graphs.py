"""DecodeGraphs: the decode step, logits included, captured as CUDA graphs at bucketed batch sizes."""

from __future__ import annotations

import logging
import time

import torch

from generation.engine.decode_inputs import DecodeFields, DecodeInputs
from generation.layers.attention import AttentionMetadata, KVCache
from generation.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def decode_batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_num_seqs (always included).

    Steps of 16 past 8 keep the padding of a replay under 16 rows; padded rows cost a little
    compute but no attention (their context is empty), and decode is bound by weight reads anyway.
    """
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


class DecodeGraphs:
    """One CUDA graph of `model`'s decode step and LM head per batch bucket, reading a packed input buffer in place.

    A decode step of n sequences replays the smallest bucket >= n. The graph of bucket bs reads
    DecodeInputs' device buffer laid out for bs rows; the first n hold the real inputs, the rest
    are padding that writes no KV (slot -1) and attends to nothing (context 0), so padded rows
    cannot disturb the cache or the real rows. Converting context lengths and the transposed block
    table to the kernels' int32 layout happens inside the graph, and so does the LM head, so a
    step costs the host one replay (and one copy when its inputs come from the host).

    Args:
        model: the model; its weights and the KV cache must stay where they are for the graphs' life.
        kv_caches: one KVCache per layer (its FP8 scales, if any, are read by pointer at each replay).
        inputs: the packed decode inputs; its device buffer must stay where it is, too.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], inputs: DecodeInputs) -> None:
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        assert device.type == "cuda", "CUDA graphs need a CUDA model"
        self.buckets = decode_batch_buckets(inputs.max_batch)
        max_bs = self.buckets[-1]
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_bs, inputs.max_blocks), -1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(max_bs, model.config.vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        started = time.perf_counter()
        pool = None
        # Largest first: it sizes the shared pool, which the smaller graphs then reuse.
        for bs in reversed(self.buckets):
            inputs.reset(bs)
            # Warm-up outside the capture: Triton compiles and cuBLAS picks its kernels here.
            self._step(model, kv_caches, inputs.fields(bs), bs)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(model, kv_caches, inputs.fields(bs), bs)
            if pool is None:
                pool = graph.pool()
                self.pool = pool  # the prefill graphs share it: one graph runs at a time
            self.graphs[bs] = graph
            torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.buckets),
                    self._bucket_summary(), time.perf_counter() - started)  # fmt: skip

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The graph batch size that serves n sequences."""
        return next(b for b in self.buckets if b >= n)

    def meta(self, fields: DecodeFields, n: int) -> AttentionMetadata:
        """The metadata the graphs attend with, first n rows (filled by a replay, valid after it)."""
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=fields.slot_mapping[:n],
            context_lens=self.context_lens[:n],
            block_tables=self.block_tables[:n],
        )

    def replay(self, n: int) -> torch.Tensor:
        """Replay the decode step over the packed inputs written for bucket(n); logits [n, V].

        The result is a view of the static output buffer: read it before the next replay.
        """
        self.graphs[self.bucket(n)].replay()
        return self.logits[:n]

    def _step(self, model: LlamaForCausalLM, kv_caches: list[KVCache], fields: DecodeFields, bs: int) -> None:
        self.context_lens[:bs].copy_(fields.context_lens)
        self.block_tables[:bs].copy_(fields.block_columns.t())
        hidden = model(fields.input_ids, fields.positions, self.meta(fields, bs), kv_caches)
        model.compute_logits(hidden, out=self.logits[:bs])

    def _bucket_summary(self) -> str:
        b = self.buckets
        return ", ".join(map(str, b)) if len(b) <= 6 else f"{b[0]}, {b[1]}, ..., {b[-1]}"
