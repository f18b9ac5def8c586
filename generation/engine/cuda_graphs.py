"""DecodeGraphs: the decode step captured as CUDA graphs at bucketed batch sizes, replayed on padded inputs."""

from __future__ import annotations

import logging
import time

import torch

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
    """One CUDA graph of `model`'s decode step per batch bucket, sharing static inputs and a memory pool.

    A decode step of n sequences replays the smallest bucket >= n: the first n rows of the static
    buffers hold the real inputs, the rest are padding that writes no KV (slot -1) and attends to
    nothing (context 0), so padded rows cannot disturb the cache or the real rows.

    Args:
        model: the model; its weights and the KV cache must stay where they are for the graphs' life.
        kv_caches: one (k_cache, v_cache) per layer.
        max_num_seqs: the largest decode batch.
        max_blocks_per_seq: block-table width, blocks of a max_model_len sequence.
    """

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        assert device.type == "cuda", "CUDA graphs need a CUDA model"
        self.buckets = decode_batch_buckets(max_num_seqs)
        max_bs = self.buckets[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_bs, max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(max_bs, model.config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        started = time.perf_counter()
        pool = None
        # Largest first: it sizes the shared pool, which the smaller graphs then reuse.
        for bs in reversed(self.buckets):
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=self.slot_mapping[:bs],
                context_lens=self.context_lens[:bs],
                block_tables=self.block_tables[:bs],
            )
            # Warm-up outside the capture: Triton compiles and cuBLAS picks its kernels here.
            self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta, kv_caches)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[:bs] = model(self.input_ids[:bs], self.positions[:bs], meta, kv_caches)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.buckets),
                    self._bucket_summary(), time.perf_counter() - started)  # fmt: skip

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Replay the decode step for n = len(input_ids) sequences; returns hidden states [n, H].

        The result is a view of the static output buffer: read it before the next replay.
        """
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = context_lens
        self.context_lens[n:bs] = 0
        # Columns past `width` keep stale block ids: the kernel reads only the blocks that a row's
        # context length covers, and those are all in the first `width` columns.
        self.block_tables[:n, : block_tables.shape[1]] = block_tables
        self.graphs[bs].replay()
        return self.outputs[:n]

    def _bucket_summary(self) -> str:
        b = self.buckets
        return ", ".join(map(str, b)) if len(b) <= 6 else f"{b[0]}, {b[1]}, ..., {b[-1]}"
