"""ModelRunner: the weights, one paged KV tensor sized from free memory, step inputs, forward and sampling."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from generation.config import EngineConfig, ModelConfig
from generation.engine.cuda_graphs import DecodeGraphs
from generation.engine.decode_inputs import DecodeInputs, block_table_rows
from generation.engine.scheduler import ScheduledBatch
from generation.layers.attention import AttentionMetadata, KVCache
from generation.layers.paged_attention import attention_backend
from generation.layers.sampler import sample
from generation.loader import load_model
from generation.models.llama import LlamaForCausalLM
from generation.sampling_params import SamplingParams
from rag.errors import ModelError

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Default KV pool on CPU (no measurement there): this many tokens per max_num_seqs, at least one
# max_model_len sequence, and never more than CPU_KV_CACHE_BYTES.
CPU_TOKENS_PER_SEQ = 512
CPU_KV_CACHE_BYTES = 512 << 20


@dataclass
class StepInputs:
    """Device tensors of one step, packed in the order of the batch's entries."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states that sample (one per `samples` entry)
    # Pure-decode step: every row samples (logits_indices is 0..T-1), and the inputs sit in the
    # packed decode buffer, laid out for a CUDA graph when `graph` is set.
    is_decode: bool = False
    graph: bool = False


class ModelRunner:
    """Loads a model and runs scheduled batches over a paged KV cache.

    On CUDA the KV cache takes what `gpu_memory_utilization` leaves after the weights and the
    peak activations of a profiling pass at `max_num_batched_tokens`; pure-decode steps replay
    CUDA graphs unless `enforce_eager`. On CPU the pool is `num_kv_blocks` or a modest default,
    and everything runs eagerly through the torch reference attention.

    Args:
        model_dir: a local Hugging Face model folder.
        config: engine settings.

    Raises:
        ModelError: the model cannot be loaded, the device is missing, max_model_len exceeds the
            model's context, or the KV cache cannot hold one sequence of max_model_len.
    """

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype_name, self.device)
        self.block_size = config.block_size
        self.model: LlamaForCausalLM
        self.model_config: ModelConfig
        self.model, self.model_config = load_model(model_dir, self.device, self.dtype)
        context = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ModelError(
                f"max_model_len {config.max_model_len} is longer than the model's context ({context} "
                f"tokens, max_position_embeddings in {model_dir / 'config.json'}): set it to {context} or less"
            )
        wanted_len = config.max_model_len or context
        self.num_kv_blocks = self._decide_num_blocks(wanted_len)
        self.max_model_len = self._fit_max_model_len(wanted_len, explicit=config.max_model_len is not None)
        # One tensor for all layers: [layers, k/v, blocks, block_size, kv_heads, head_dim]. Zeros,
        # not empty: padding reads of the reference path must not meet NaN garbage.
        self.kv_cache = torch.zeros(self._kv_shape(self.num_kv_blocks), dtype=self.dtype, device=self.device)
        self.kv_caches: list[KVCache] = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        num_tokens = self.num_kv_blocks * self.block_size
        logger.info(
            "KV cache: %d tokens (%d blocks of %d, %.2f GiB, %s); max concurrency at max_model_len %d: %.2fx",
            num_tokens, self.num_kv_blocks, self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / GIB,
            self.dtype, self.max_model_len, num_tokens / self.max_model_len,
        )  # fmt: skip
        # Pure-decode steps pack their inputs here: one host-to-device copy per step.
        # Rows 0..n-1 of a decode step's hidden states all sample: a view of this, never a copy.
        self._all_rows = torch.arange(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.block_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if attention_backend(self.device) != "triton":
                # The torch reference stores KV through a boolean mask (a host sync): not capturable.
                logger.warning("Triton is not available: attention runs the torch reference, without CUDA graphs")
            else:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(self.model, self.kv_caches, self.decode_inputs)

    # ---------------------------------------------------------------------------------------------
    # A step
    # ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """Run the batch and sample one token per entry with `samples`, in entry order.

        Args:
            batch: the scheduler's step.
            params, generators: one per sampling entry (batch.sampling_entries), in that order.

        Returns:
            The sampled token ids, one per sampling entry.
        """
        logits = self._logits(batch)
        if logits.shape[0] == 0:
            return []
        if all(p.is_greedy for p in params):
            # Argmax in the head's dtype: widening to fp32 is exact, so the pick is the same
            # without materialising [N, V] fp32 logits. One small device-to-host copy follows.
            return logits.argmax(dim=-1).tolist()
        return sample(logits, params, generators).tolist()

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the batch (writing its KV) and return fp32 logits [N, V] of its sampling entries."""
        return self._logits(batch).float()

    def _logits(self, batch: ScheduledBatch) -> torch.Tensor:
        inputs = self.prepare_inputs(batch)
        hidden = self.forward(inputs)
        if not inputs.is_decode:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the entries' new tokens, positions, cache slots and block tables into device tensors."""
        assert not batch.is_empty
        if all(e.is_decode for e in batch.entries) and len(batch.entries) <= self.decode_inputs.max_batch:
            return self._prepare_decode(batch)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        cu_seqlens = [0]
        logits_indices: list[int] = []
        for entry in batch.entries:
            seq, start, n = entry.seq, entry.start_pos, entry.num_new_tokens
            end = start + n
            if n == 1:  # decodes, the bulk of a large batch: no slices, no ranges
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += seq.slot_mapping(start, end, bs)
            context_lens.append(end)
            cu_seqlens.append(cu_seqlens[-1] + n)
            if entry.samples:
                logits_indices.append(cu_seqlens[-1] - 1)
        # Only the blocks each row's context covers; a prompt's later blocks are not read yet.
        # numpy row fills: several times faster than torch.tensor on nested lists at batch 256.
        num_blocks = [-(-end // bs) for end in context_lens]
        tables = np.full((len(context_lens), max(num_blocks)), -1, dtype=np.int32)
        for row, (entry, k) in enumerate(zip(batch.entries, num_blocks, strict=True)):
            tables[row, :k] = entry.seq.block_table[:k]
        is_prefill = not all(e.is_decode for e in batch.entries)
        meta = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=self._to_device(slots, torch.int64),
            context_lens=self._to_device(context_lens, torch.int32),
            block_tables=self._to_device(torch.from_numpy(tables), torch.int32),
            cu_seqlens_q=self._to_device(cu_seqlens, torch.int32) if is_prefill else None,
        )
        return StepInputs(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            meta=meta,
            logits_indices=self._to_device(logits_indices, torch.int64),
        )

    def _prepare_decode(self, batch: ScheduledBatch) -> StepInputs:
        """Inputs of a pure-decode step, packed and sent with one copy (no per-field tensors)."""
        n = len(batch.entries)
        graph = self.graphs is not None and n <= self.graphs.max_batch_size
        # A graph reads the layout of its bucket, padding rows included; eager runs take n rows.
        rows = self.graphs.bucket(n) if graph and self.graphs is not None else n
        width = self.decode_inputs.write(batch.entries, rows)
        fields = self.decode_inputs.fields(rows)
        if graph and self.graphs is not None:
            meta = self.graphs.meta(fields, n)
        else:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=fields.slot_mapping[:n],
                context_lens=fields.context_lens[:n].to(torch.int32),
                block_tables=block_table_rows(fields.block_columns, n, width),
            )
        return StepInputs(
            input_ids=fields.input_ids[:n],
            positions=fields.positions[:n],
            meta=meta,
            logits_indices=self._all_rows[:n],
            is_decode=True,
            graph=graph,
        )

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, H] of a step: a CUDA graph replay for decodes that fit one, else eager."""
        if inputs.graph and self.graphs is not None:
            return self.graphs.replay(len(inputs.input_ids))
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)

    def _to_device(self, data: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        if self.device.type != "cuda":
            return host
        # Pinned host memory lets the copy run asynchronously with the host preparing what follows.
        return host.pin_memory().to(self.device, non_blocking=True)

    # ---------------------------------------------------------------------------------------------
    # KV cache sizing
    # ---------------------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        return math.prod(self._kv_shape(1)) * torch.empty((), dtype=self.dtype).element_size()

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.model_config
        return (c.num_hidden_layers, 2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)

    def _decide_num_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        # More than max_num_seqs full-length sequences can never be in use; a small model on a big
        # GPU would otherwise get tens of millions of blocks, and the block manager's lists with them.
        useful = math.ceil(self.config.max_num_seqs * max_model_len / self.block_size)
        if self.device.type != "cuda":
            tokens = max(max_model_len, self.config.max_num_seqs * CPU_TOKENS_PER_SEQ)
            blocks = math.ceil(tokens / self.block_size)
            return max(1, min(blocks, useful, CPU_KV_CACHE_BYTES // self.block_bytes))
        return min(self._measure_num_blocks(max_model_len), useful)

    def _measure_num_blocks(self, max_model_len: int) -> int:
        """Blocks that fit in gpu_memory_utilization of the GPU after weights and peak activations."""
        activation_bytes = self._profile_activation_bytes(max_model_len)
        free, total = torch.cuda.mem_get_info(self.device)
        # `used` holds the weights, the CUDA context, cuBLAS workspaces and other processes' memory.
        used = total - free
        budget = total * self.config.gpu_memory_utilization - used - activation_bytes
        logger.info(
            "GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak activations at %d tokens; "
            "%.2f GiB left for the KV cache at gpu_memory_utilization %.2f",
            total / GIB, used / GIB, activation_bytes / GIB, self.config.max_num_batched_tokens, max(budget, 0) / GIB,
            self.config.gpu_memory_utilization,
        )  # fmt: skip
        return max(0, int(budget // self.block_bytes))

    @torch.inference_mode()
    def _profile_activation_bytes(self, max_model_len: int) -> int:
        """Peak memory of a forward + sampling at max_num_batched_tokens, beyond the weights.

        The pass needs a KV cache to write to; a temporary one just large enough is allocated and
        its size is taken back out of the peak.
        """
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(max_model_len, num_tokens)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks = [math.ceil(n / self.block_size) for n in lens]
        kv = torch.zeros(self._kv_shape(sum(blocks)), dtype=self.dtype, device=device)
        temp_bytes = kv.numel() * kv.element_size()
        kv_caches: list[KVCache] = [(layer[0], layer[1]) for layer in kv]
        first_block = [0]
        for b in blocks[:-1]:
            first_block.append(first_block[-1] + b)
        tables = [[f + i for i in range(max(blocks))] for f in first_block]  # rows past a sequence are unread
        positions = [p for n in lens for p in range(n)]
        slots = [f * self.block_size + p for f, n in zip(first_block, lens, strict=True) for p in range(n)]
        cu_seqlens = [0]
        for n in lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        hidden = self.model(input_ids, torch.tensor(positions, dtype=torch.int64, device=device), meta, kv_caches)
        # Logits and sampling for a full decode batch: the vocabulary-sized tensors are large.
        rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows]).float()
        sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)] + [SamplingParams()] * (rows - 1), [None] * rows)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del kv, kv_caches, meta, hidden, logits
        torch.cuda.empty_cache()
        return max(0, peak - base - temp_bytes)

    def _fit_max_model_len(self, wanted: int, explicit: bool) -> int:
        pool_tokens = self.num_kv_blocks * self.block_size
        if pool_tokens >= wanted:
            return wanted
        if explicit or pool_tokens < 2:
            raise ModelError(
                f"the KV cache holds {pool_tokens} tokens ({self.num_kv_blocks} blocks of {self.block_size}), "
                f"less than one sequence of max_model_len {wanted}: lower max_model_len to {max(pool_tokens, 0)} or "
                "less, raise gpu_memory_utilization or num_kv_blocks, lower max_num_batched_tokens, or use a "
                "device with more free memory"
            )
        logger.warning(
            "the KV cache holds %d tokens, fewer than the model's context of %d: max_model_len lowered to %d "
            "(set max_model_len, or give the engine more memory)", pool_tokens, wanted, pool_tokens,
        )  # fmt: skip
        return pool_tokens


def pick_device(device: str | None) -> torch.device:
    """The torch device for a name, CUDA when None and available.

    Raises:
        ModelError: CUDA asked for but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} was asked for but CUDA is not available: use 'cpu'")
    return dev


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU unless a dtype name is given."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
