"""ModelRunner: the weights, one paged KV tensor, and a scheduled batch's steps run back to back on the device."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from generation.config import EngineConfig, ModelConfig
from generation.engine.decode_graphs import DecodeGraphs
from generation.engine.decode_inputs import DecodeInputs, block_table_rows
from generation.engine.host_kv_buffer import HostKVBuffer
from generation.engine.kv_cache_dtype import kv_cache_scales, resolve_kv_cache_dtype
from generation.engine.kv_cache_sizing import GIB, decide_num_blocks, fit_max_model_len, kv_shape
from generation.engine.prefill_graphs import PrefillGraphs
from generation.engine.scheduler import ScheduledBatch, ScheduledEntry
from generation.layers.attention import AttentionMetadata, KVCache, layer_kv_caches
from generation.layers.fp8 import fp8_kernels_serve, fp8_layers
from generation.layers.kernel_choice import triton_fused_for, triton_kv_copy_for
from generation.layers.kernel_warmup import compile_attention_variants
from generation.layers.linear import Linear
from generation.layers.paged_attention import attention_backend
from generation.layers.rerotation import copy_blocks_rerotated
from generation.layers.sampler import sample
from generation.loader import load_model
from generation.models.llama import LlamaForCausalLM
from generation.sampling_params import SamplingParams
from rag.errors import ModelError

logger = logging.getLogger(__name__)

# Steps of a multi-step batch queued on the device past the one the host is reading. One is
# enough to keep the device busy (a launch takes far less host time than a decode step takes the
# device), and it bounds how many steps still run once the batch is told to stop.
LAUNCH_AHEAD = 1


@dataclass
class StepInputs:
    """Device tensors of one step, packed in the order of the batch's entries."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states that sample (one per `samples` entry)
    # Pure-decode step: every row samples (logits_indices is 0..T-1), and the inputs sit in the
    # packed decode buffer, laid out for a CUDA graph when `decode_graph` is set.
    is_decode: bool = False
    decode_graph: bool = False
    # A small prefill step whose inputs sit in PrefillGraphs' buffer: a graph replay serves it.
    prefill_graph: bool = False


@dataclass
class _BatchRun:
    """What launching a multi-step batch's later steps needs: the last step's sampled tokens (on the device)."""

    num_rows: int
    tokens: torch.Tensor
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    greedy: bool


class ModelRunner:
    """Loads a model and runs scheduled batches over a paged KV cache.

    On CUDA the KV cache takes what `gpu_memory_utilization` leaves after the weights and the
    peak activations of a profiling pass at `max_num_batched_tokens`; decode steps and small
    prefill steps replay CUDA graphs (logits included) unless `enforce_eager`. On CPU the pool is
    `num_kv_blocks` or a modest default, and everything runs eagerly through the torch reference.

    A batch of several steps (ScheduledBatch.num_steps) keeps LAUNCH_AHEAD steps queued past the
    one the host reads: each later step is a decode of every entry whose input token is the one
    the step before sampled, moved into place on the device (DecodeInputs.advance), so the host
    never waits for a token to launch the next step. It reads each step's tokens as that step
    completes, its processing overlapping the step after, and a batch can stop early (every
    entry finished, or a request waiting to join) without running the steps nobody would read.

    Args:
        model_dir: a local Hugging Face model folder.
        config: engine settings.

    Raises:
        ModelError: the model cannot be loaded, the device is missing, max_model_len exceeds the
            model's context (max_position_embeddings, or a smaller sliding window), or the KV cache
            cannot hold one sequence of max_model_len.
    """

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype_name, self.device)
        self.block_size = config.block_size
        self.model: LlamaForCausalLM
        self.model_config: ModelConfig
        self.model, self.model_config = load_model(
            model_dir, self.device, self.dtype, quantization=config.quantization, load_format=config.load_format
        )
        context = self.model_config.context_len
        # Where the context is capped at a sliding window (Mistral v0.1), name that as the limit.
        windowed = context < self.model_config.max_position_embeddings
        limit = "sliding_window" if windowed else "max_position_embeddings"
        why = " (sliding-window attention is not implemented; within the window it equals full attention)"
        if config.max_model_len is not None and config.max_model_len > context:
            raise ModelError(
                f"max_model_len {config.max_model_len} is longer than the model's context ({context} "
                f"tokens, {limit} in {model_dir / 'config.json'}): set it to {context} or less"
                f"{why if windowed else ''}"
            )
        if windowed and config.max_model_len is None:
            logger.warning(
                "%s: the sliding window (%d tokens) is shorter than max_position_embeddings (%d): max_model_len "
                "capped at %d, within which full attention equals sliding-window attention (longer sequences "
                "would need sliding-window attention, which this engine does not implement)",
                model_dir, context, self.model_config.max_position_embeddings, context,
            )  # fmt: skip
        wanted_len = config.max_model_len or context
        self._choose_matmul_kernels()  # before the KV cache is sized: its timing buffers are freed by then
        # The KV tensor's storage: the model's dtype, or e4m3 with per-layer K/V scales (kv_scales).
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.num_kv_blocks = decide_num_blocks(self.model, config, self.device, self.dtype, wanted_len, self.kv_dtype)
        self.max_model_len = fit_max_model_len(
            self.num_kv_blocks, self.block_size, wanted_len, explicit=config.max_model_len is not None
        )
        # Zeros, not empty: padding reads of the reference path must not meet NaN garbage.
        shape = kv_shape(self.model_config, self.num_kv_blocks, self.block_size)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # [layers, 2] fp32 (K, V) for an FP8 cache, else None; the kernels read them by pointer.
        self.kv_scales = kv_cache_scales(self.model, self.model_config.num_hidden_layers, self.kv_dtype, self.device)
        self.kv_caches: list[KVCache] = layer_kv_caches(self.kv_cache, self.kv_scales)
        # The host tier's memory (EngineConfig.host_kv_blocks); its bookkeeping is the block manager's.
        self.host_kv = HostKVBuffer(self.kv_cache, config.host_kv_blocks) if config.host_kv_blocks else None
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        num_tokens = self.num_kv_blocks * self.block_size
        logger.info(
            "KV cache: %d tokens (%d blocks of %d, %.2f GiB, %s); max concurrency at max_model_len %d: %.2fx",
            num_tokens, self.num_kv_blocks, self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / GIB,
            self.kv_dtype, self.max_model_len, num_tokens / self.max_model_len,
        )  # fmt: skip
        self.num_scheduler_steps = config.scheduler_steps_on(self.device.type)
        # Decode steps read their inputs from here: one host-to-device copy per batch.
        # Rows 0..n-1 of a decode step's hidden states all sample: a view of this, never a copy.
        self._all_rows = torch.arange(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.decode_inputs = DecodeInputs(config.max_num_seqs, self.max_blocks_per_seq, self.block_size, self.device)
        # Each step's sampled tokens land here; on CUDA an event per step says when they have.
        cuda = self.device.type == "cuda"
        self._sampled = torch.zeros(self.num_scheduler_steps, config.max_num_seqs, dtype=torch.int64, pin_memory=cuda)
        self._sampled_np = self._sampled.numpy()
        self._step_done = [torch.cuda.Event() for _ in range(self.num_scheduler_steps)] if cuda else []
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if cuda and attention_backend(self.device) == "triton":
            # Now, not at the first step of a shape that needs one: a compile stalls a step for seconds.
            first = self.kv_caches[0]
            compile_attention_variants(
                first.k_cache, first.v_cache, self.model_config.num_attention_heads,
                config.max_num_seqs, self.max_blocks_per_seq, config.max_num_batched_tokens,
                q_dtype=self.dtype, k_scale=first.k_scale, v_scale=first.v_scale,
            )  # fmt: skip
            from generation.engine.triton_advance import advance_decode_rows

            scratch = torch.zeros(5, dtype=torch.int64, device=self.device)  # one row, one block column
            advance_decode_rows(scratch, scratch[:1].clone(), 1, 1, 1, self.block_size)  # compiles it
        if cuda and not config.enforce_eager:
            if attention_backend(self.device) != "triton":
                # The torch reference stores KV through a boolean mask (a host sync): not capturable.
                logger.warning("Triton is not available: attention runs the torch reference, without CUDA graphs")
            else:
                with torch.inference_mode():
                    self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.decode_inputs)
                    self.prefill_graphs = PrefillGraphs(
                        self.model, self.kv_caches, self.max_blocks_per_seq, self.decode_graphs.pool
                    )

    def _choose_matmul_kernels(self) -> None:
        """Time cuBLAS against the Triton skinny matmul on each weight shape (CUDA, fused kernels on)."""
        if triton_fused_for(torch.empty(0, device=self.device)) is None:
            return
        from generation.layers import triton_skinny_gemm

        triton_skinny_gemm.choose([m.weight for m in self.model.modules() if isinstance(m, Linear)])
        fp8 = fp8_layers(self.model)
        if fp8 and fp8_kernels_serve(self.device):
            from generation.layers import triton_fp8

            triton_fp8.choose([(m.weight, m.weight_scale) for m in fp8], self.dtype)

    # ---------------------------------------------------------------------------------------------
    # A batch
    # ---------------------------------------------------------------------------------------------

    def execute(
        self,
        batch: ScheduledBatch,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        stop_early: Callable[[], bool] | None = None,
    ) -> Iterator[list[int]]:
        """Run the batch's steps; yield each step's sampled tokens, one per sampling entry in entry order.

        Steps are launched LAUNCH_AHEAD ahead of the one the host reads: reading step j waits
        for step j alone, so what the caller does with it overlaps the step after it, and the
        batch can end early without the device running steps nobody reads. Leaving the iterator
        early launches nothing more (the steps already queued finish and their tokens are dropped).

        Args:
            batch: the scheduler's batch (num_steps > 1 only when every entry samples).
            params, generators: one per sampling entry (batch.sampling_entries), in that order.
            stop_early: asked before each later step is launched; True ends the batch after the
                steps already launched (a request is waiting to join: the scheduler gets it in
                sooner than the batch's last step). The iterator then yields fewer than num_steps.
        """
        assert batch.num_steps <= self.num_scheduler_steps
        with torch.inference_mode():
            run = self._launch_first(batch, params, generators)
        if run is None:
            return
        num_steps, launched, step = batch.num_steps, 1, 0
        while step < launched:
            while launched < num_steps and launched <= step + LAUNCH_AHEAD:
                if stop_early is not None and stop_early():
                    num_steps = launched  # nothing more is launched; the queued steps are still read
                    break
                with torch.inference_mode():
                    self._launch_next(run, launched)
                launched += 1
            if self._step_done:
                self._step_done[step].synchronize()
            yield self._sampled_np[step, : run.num_rows].tolist()
            step += 1

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the batch's first step (writing its KV) and return fp32 logits [N, V] of its sampling entries."""
        if self.host_kv is not None:
            self.host_kv.before_step(lambda: touched_blocks(batch))
        self.copy_kv_blocks(batch.kv_copies)
        return self.step_logits(self.prepare_inputs(batch)).float()

    def copy_kv_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy whole KV blocks (every layer) from source to destination, keys moved by the delta.

        Chunk KV reuse, KV-REUSE.md B4 option B: a chunk cached at one position is copied into a
        request's private blocks at another, keys re-rotated once in fp32 (`rerotate_keys`): by
        torch (`copy_blocks_rerotated`), or on CUDA in one Triton launch (`triton_kv_copy`). An FP8
        cache's keys are dequantized, re-rotated and quantized again with their layer's K scale.

        Args:
            copies: (source block, destination block, position delta); sources are only read.
        """
        if not copies:
            return
        inv_freq = self.model.model.rotary_emb.inv_freq
        k_scales = self.kv_scales[:, 0] if self.kv_scales is not None else None
        fused = triton_kv_copy_for(self.kv_cache)
        if fused is not None:  # one launch for every copy, the indices sent without a host sync
            fused.copy_rerotate_blocks(self.kv_cache, copies, inv_freq, k_scales)
            return
        copy_blocks_rerotated(self.kv_cache, copies, inv_freq, k_scales)

    def _launch_first(
        self, batch: ScheduledBatch, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> _BatchRun | None:
        """Queue the batch's first step on the device; None when no entry samples."""
        if self.host_kv is not None:
            # After the host tier's copies of this schedule; waits only for the copies back it reads.
            self.host_kv.before_step(lambda: touched_blocks(batch))
        self.copy_kv_blocks(batch.kv_copies)
        inputs = self.prepare_inputs(batch)
        logits = self.step_logits(inputs)
        num_rows = logits.shape[0]
        if num_rows == 0:
            return None
        greedy = all(p.is_greedy for p in params)
        tokens = self._pick(logits, params, generators, greedy)
        self._publish(0, tokens)
        if batch.num_steps > 1 and not inputs.is_decode:
            # A prefill step came first: lay out every entry at the last token it fed, so that
            # advancing moves each row to the token just sampled.
            self._write_decode(batch.entries)
        return _BatchRun(num_rows, tokens, params, generators, greedy)

    def _launch_next(self, run: _BatchRun, step: int) -> None:
        """Queue decode step `step` of a multi-step batch, fed the tokens the step before sampled."""
        self.decode_inputs.advance(run.tokens)
        logits = self.step_logits(self._decode_step_inputs())
        run.tokens = self._pick(logits, run.params, run.generators, run.greedy)
        self._publish(step, run.tokens)

    def _pick(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], greedy: bool
    ) -> torch.Tensor:
        # Argmax in the head's dtype: widening to fp32 is exact, so the pick is the same without
        # materialising [N, V] fp32 logits.
        return logits.argmax(dim=-1) if greedy else sample(logits, params, generators)

    def _publish(self, step: int, tokens: torch.Tensor) -> None:
        """Copy a step's tokens to the host buffer (asynchronously on CUDA) and mark when they are there."""
        self._sampled[step, : tokens.shape[0]].copy_(tokens, non_blocking=True)
        if self._step_done:
            self._step_done[step].record()

    # ---------------------------------------------------------------------------------------------
    # A step
    # ---------------------------------------------------------------------------------------------

    def step_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [N, V] of the step's sampling rows (in the model's dtype): a graph replay or an eager forward.

        A replay's logits are a view of the graph's static buffer: use them before the next replay.
        """
        if inputs.decode_graph and self.decode_graphs is not None:
            return self.decode_graphs.replay(len(inputs.input_ids))
        if inputs.prefill_graph and self.prefill_graphs is not None:
            return self.prefill_graphs.replay(len(inputs.input_ids), len(inputs.logits_indices))
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        if not inputs.is_decode:
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Pack the entries' new tokens, positions, cache slots and block tables into device tensors."""
        assert not batch.is_empty
        if all(e.is_decode for e in batch.entries) and len(batch.entries) <= self.decode_inputs.max_batch:
            self._write_decode(batch.entries)
            return self._decode_step_inputs()
        block_size = self.block_size
        entries = batch.entries
        # Leading one-token decodes go to the decode kernel; cu_seqlens covers the entries after them.
        num_decodes = 0
        while num_decodes < len(entries) and entries[num_decodes].is_decode:
            num_decodes += 1
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        cu_seqlens = [0]  # over all entries
        logits_indices: list[int] = []
        for entry in entries:
            seq, start, n = entry.seq, entry.start_pos, entry.num_new_tokens
            end = start + n
            if n == 1:  # decodes, the bulk of a large batch: no slices, no ranges
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // block_size] * block_size + start % block_size)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += seq.slot_mapping(start, end, block_size)
            context_lens.append(end)
            cu_seqlens.append(cu_seqlens[-1] + n)
            if entry.samples:
                logits_indices.append(cu_seqlens[-1] - 1)
        # Only the blocks each row's context covers; a prompt's later blocks are not read yet.
        # numpy row fills: several times faster than torch.tensor on nested lists at batch 256.
        num_blocks = [-(-end // block_size) for end in context_lens]
        tables = np.full((len(context_lens), max(num_blocks)), -1, dtype=np.int32)
        for row, (entry, k) in enumerate(zip(entries, num_blocks, strict=True)):
            tables[row, :k] = entry.seq.block_table[:k]
        graphs = self.prefill_graphs
        if graphs is not None and graphs.fits(len(input_ids), len(entries)):
            meta = graphs.write(input_ids, positions, slots, cu_seqlens, context_lens, tables, logits_indices)
            return StepInputs(
                input_ids=graphs.input_ids(len(input_ids)),
                positions=graphs.positions(len(input_ids)),
                meta=meta,
                logits_indices=graphs.logits_indices(len(logits_indices)),
                prefill_graph=True,
            )
        is_prefill = num_decodes < len(entries)
        meta = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=self._to_device(slots, torch.int64),
            context_lens=self._to_device(context_lens, torch.int32),
            block_tables=self._to_device(torch.from_numpy(tables), torch.int32),
            # The prefill kernel's boundaries start after the leading decodes (see AttentionMetadata).
            cu_seqlens_q=self._to_device([c - num_decodes for c in cu_seqlens[num_decodes:]], torch.int32)
            if is_prefill
            else None,
            num_decodes=num_decodes if is_prefill else 0,
        )
        return StepInputs(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            meta=meta,
            logits_indices=self._to_device(logits_indices, torch.int64),
        )

    def _write_decode(self, entries: list[ScheduledEntry]) -> None:
        """Pack a decode layout of the entries (CUDA-graph padded when a graph serves their number)."""
        n = len(entries)
        graph = self.decode_graphs is not None and n <= self.decode_graphs.max_batch_size
        # A graph reads the layout of its bucket, padding rows included; eager runs take n rows.
        rows = self.decode_graphs.bucket(n) if graph and self.decode_graphs is not None else n
        self.decode_inputs.write(entries, rows)

    def _decode_step_inputs(self) -> StepInputs:
        """Inputs of a decode step over the packed buffer as it stands (no host copy)."""
        inputs = self.decode_inputs
        n, rows = inputs.num_rows, inputs.bs
        fields = inputs.fields(rows)
        graph = self.decode_graphs is not None and n <= self.decode_graphs.max_batch_size
        if graph and self.decode_graphs is not None:
            meta = self.decode_graphs.meta(fields, n)
        else:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=fields.slot_mapping[:n],
                context_lens=fields.context_lens[:n].to(torch.int32),
                block_tables=block_table_rows(fields.block_columns, n, inputs.width),
            )
        return StepInputs(
            input_ids=fields.input_ids[:n],
            positions=fields.positions[:n],
            meta=meta,
            logits_indices=self._all_rows[:n],
            is_decode=True,
            decode_graph=graph,
        )

    def _to_device(self, data: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        if self.device.type != "cuda":
            return host
        # Pinned host memory lets the copy run asynchronously with the host preparing what follows.
        return host.pin_memory().to(self.device, non_blocking=True)


def touched_blocks(batch: ScheduledBatch) -> set[int]:
    """Every KV block a batch's steps read or write: its sequences' block tables (lookahead blocks
    included, reserved at scheduling) and its chunk copies' sources and destinations."""
    blocks = {block_id for entry in batch.entries for block_id in entry.seq.block_table}
    for src, dst, _ in batch.kv_copies:
        blocks.add(src)
        blocks.add(dst)
    return blocks


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
