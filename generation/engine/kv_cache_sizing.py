"""KV cache sizing: blocks that fit after the weights and a profiled forward's peak activations."""

from __future__ import annotations

import logging
import math

import torch

from generation.config import EngineConfig, ModelConfig
from generation.engine.kv_cache_dtype import kv_cache_scales
from generation.layers.attention import AttentionMetadata, layer_kv_caches
from generation.layers.sampler import sample
from generation.models.llama import LlamaForCausalLM
from generation.sampling_params import SamplingParams
from rag.errors import ModelError

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Default KV pool on CPU (no measurement there): this many tokens per max_num_seqs, at least one
# max_model_len sequence, and never more than CPU_KV_CACHE_BYTES.
CPU_TOKENS_PER_SEQ = 512
CPU_KV_CACHE_BYTES = 512 << 20


def kv_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One tensor for all layers: [layers, k/v, blocks, block_size, kv_heads, head_dim]."""
    c = model_config
    return (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers (K and V), stored in `dtype` (the cache's: 1 byte for FP8)."""
    return math.prod(kv_shape(model_config, 1, block_size)) * torch.empty((), dtype=dtype).element_size()


# Host tier (HostKVBuffer): GPU blocks that copies out are gathered into, so that the step after
# an eviction need not wait for PCIe. Enough for the blocks a typical step evicts (a few
# prompts' worth); 512 MiB for Llama-3.1-8B.
STAGING_BLOCKS = 256


def staging_size(host_blocks: int, staging_blocks: int = STAGING_BLOCKS) -> int:
    """GPU staging blocks the host tier uses on CUDA (the KV cache sizing leaves room for them)."""
    return max(1, min(host_blocks, staging_blocks))


def decide_num_blocks(
    model: LlamaForCausalLM,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """KV blocks to allocate: config.num_kv_blocks, else a CPU default, else what the GPU has room for.

    Args:
        dtype: the model's dtype (the profiling pass's activations).
        kv_dtype: the cache's storage dtype (resolve_kv_cache_dtype), `dtype` when None. Blocks are
            counted in its bytes, so an FP8 cache holds twice the tokens of a bf16 one.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    kv_dtype = kv_dtype or dtype
    # More than max_num_seqs full-length sequences can never be in use; a small model on a big
    # GPU would otherwise get tens of millions of blocks, and the block manager's lists with them.
    useful = math.ceil(config.max_num_seqs * max_model_len / config.block_size)
    per_block = block_bytes(model.config, config.block_size, kv_dtype)
    if device.type != "cuda":
        tokens = max(max_model_len, config.max_num_seqs * CPU_TOKENS_PER_SEQ)
        blocks = math.ceil(tokens / config.block_size)
        return max(1, min(blocks, useful, CPU_KV_CACHE_BYTES // per_block))
    activation_bytes = profile_activation_bytes(model, config, device, dtype, max_model_len, kv_dtype)
    free, total = torch.cuda.mem_get_info(device)
    # `used` holds the weights, the CUDA context, cuBLAS workspaces and other processes' memory.
    used = total - free
    budget = total * config.gpu_memory_utilization - used - activation_bytes
    if config.host_kv_blocks:
        budget -= staging_size(config.host_kv_blocks) * per_block  # the host tier's copy-out staging
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB peak activations at %d tokens; "
        "%.2f GiB left for the KV cache at gpu_memory_utilization %.2f",
        total / GIB, used / GIB, activation_bytes / GIB, config.max_num_batched_tokens, max(budget, 0) / GIB,
        config.gpu_memory_utilization,
    )  # fmt: skip
    return min(max(0, int(budget // per_block)), useful)


@torch.inference_mode()
def profile_activation_bytes(
    model: LlamaForCausalLM,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Peak memory of a forward + sampling at max_num_batched_tokens, beyond the weights.

    The pass needs a KV cache to write to; a temporary one just large enough (in `kv_dtype`, the
    model's dtype when None, so the pass runs the kernels serving will) is allocated and its
    size is taken back out of the peak.
    """
    kv_dtype = kv_dtype or dtype
    block_size = config.block_size
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    num_tokens = config.max_num_batched_tokens
    seq_len = min(max_model_len, num_tokens)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks = [math.ceil(n / block_size) for n in lens]
    kv = torch.zeros(kv_shape(model.config, sum(blocks), block_size), dtype=kv_dtype, device=device)
    scales = kv_cache_scales(model, model.config.num_hidden_layers, kv_dtype, device)
    temp_bytes = kv.numel() * kv.element_size() + (scales.numel() * scales.element_size() if scales is not None else 0)
    kv_caches = layer_kv_caches(kv, scales)
    first_block = [0]
    for b in blocks[:-1]:
        first_block.append(first_block[-1] + b)
    tables = [[f + i for i in range(max(blocks))] for f in first_block]  # rows past a sequence are unread
    positions = [p for n in lens for p in range(n)]
    slots = [f * block_size + p for f, n in zip(first_block, lens, strict=True) for p in range(n)]
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
    hidden = model(input_ids, torch.tensor(positions, dtype=torch.int64, device=device), meta, kv_caches)
    # Logits and sampling for a full decode batch: the vocabulary-sized tensors are large.
    rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:rows]).float()
    sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)] + [SamplingParams()] * (rows - 1), [None] * rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del kv, scales, kv_caches, meta, hidden, logits
    torch.cuda.empty_cache()
    return max(0, peak - base - temp_bytes)


def fit_max_model_len(num_blocks: int, block_size: int, wanted: int, explicit: bool) -> int:
    """max_model_len the pool can hold: `wanted`, or (when not explicit) lowered to the pool with a warning.

    Raises:
        ModelError: the pool cannot hold one sequence of an explicit max_model_len (or of 2 tokens).
    """
    pool_tokens = num_blocks * block_size
    if pool_tokens >= wanted:
        return wanted
    if explicit or pool_tokens < 2:
        raise ModelError(
            f"the KV cache holds {pool_tokens} tokens ({num_blocks} blocks of {block_size}), "
            f"less than one sequence of max_model_len {wanted}: lower max_model_len to {max(pool_tokens, 0)} or "
            "less, raise gpu_memory_utilization or num_kv_blocks, lower max_num_batched_tokens, or use a "
            "device with more free memory"
        )
    logger.warning(
        "the KV cache holds %d tokens, fewer than the model's context of %d: max_model_len lowered to %d "
        "(set max_model_len, or give the engine more memory)", pool_tokens, wanted, pool_tokens,
    )  # fmt: skip
    return pool_tokens
