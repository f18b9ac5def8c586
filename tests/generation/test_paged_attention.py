"""The paged-attention torch reference equals plain dense causal attention on contiguous tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from generation.layers.paged_attention import (
    attention_backend,
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    store_kvcache,
    store_kvcache_torch,
)


@dataclass
class PagedCase:
    """Sequences whose K/V sit in shuffled physical blocks of a cache full of unrelated values."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence, dense [ctx, Hkv, D]
    values: list[torch.Tensor]
    slots: list[torch.Tensor]  # per sequence, cache slot of each position [ctx] int64


def make_paged_case(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 2,
) -> PagedCase:
    """Random dense K/V per sequence, scattered into randomly permuted cache blocks.

    The cache starts as noise, so reading a wrong slot changes the result; spare blocks and -1
    table columns check that nothing past a sequence's length is read.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(needed) + spare_columns), -1, dtype=torch.int32)
    keys, values, slots = [], [], []
    used = 0
    for i, (ctx, n_blocks) in enumerate(zip(context_lens, needed, strict=True)):
        blocks = perm[used : used + n_blocks]
        used += n_blocks
        tables[i, :n_blocks] = blocks.to(torch.int32)
        pos = torch.arange(ctx)
        slot = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        # Written with plain indexing, independently of store_kvcache.
        k_cache.view(-1, num_kv_heads, head_dim)[slot] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slot] = v
        keys.append(k.to(device))
        values.append(v.to(device))
        slots.append(slot.to(device))
    return PagedCase(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        slots=slots,
    )


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal SDPA over a whole sequence: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D] fp32."""
    group = q.shape[1] // k.shape[1]
    # Expand KV heads to query heads (head h uses KV head h // group).
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def full_queries(context_lens: list[int], num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1):
    """One random query per position of every sequence."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in context_lens]


HEADS = [(4, 4, 16), (8, 2, 32), (9, 3, 64)]  # (query heads, KV heads, head dim): MHA, GQA 4:1, SmolLM2's 3:1


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_without_prefix_equals_dense(num_heads, num_kv_heads, head_dim, block_size):
    lens = [1, 15, 16, 17, 40]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size)
    qs = full_queries(lens, num_heads, head_dim, torch.float32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = paged_prefill_attention_torch(
        torch.cat(qs), case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, scale
    )
    for i, q in enumerate(qs):
        ref = dense_causal_attention(q, case.keys[i], case.values[i], scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_prefill_with_cached_prefix_equals_last_rows_of_dense(num_heads, num_kv_heads, head_dim):
    lens = [17, 33, 5, 64, 16]
    new = [1, 16, 5, 30, 3]  # the last `new` positions are this step's tokens, the rest is cached prefix
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size=8, seed=3)
    qs = full_queries(lens, num_heads, head_dim, torch.float32)
    q = torch.cat([qi[-n:] for qi, n in zip(qs, new, strict=True)])
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = paged_prefill_attention_torch(q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, scale)
    for i, n in enumerate(new):
        ref = dense_causal_attention(qs[i], case.keys[i], case.values[i], scale)[-n:]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot():
    lens, split = [50], 23
    case = make_paged_case(lens, 2, 16, block_size=4, seed=5)
    (q,) = full_queries(lens, 6, 16, torch.float32)
    tables, scale = case.block_tables, 0.25
    whole = paged_prefill_attention_torch(
        q, case.k_cache, case.v_cache, torch.tensor([0, 50], dtype=torch.int32), case.context_lens, tables, scale
    )
    # First chunk: only `split` tokens exist yet; second chunk: the rest, with the first as prefix.
    first = paged_prefill_attention_torch(
        q[:split], case.k_cache, case.v_cache, torch.tensor([0, split], dtype=torch.int32),
        torch.tensor([split], dtype=torch.int32), tables, scale,
    )  # fmt: skip
    second = paged_prefill_attention_torch(
        q[split:], case.k_cache, case.v_cache, torch.tensor([0, 50 - split], dtype=torch.int32),
        case.context_lens, tables, scale,
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_equals_last_row_of_dense(num_heads, num_kv_heads, head_dim, block_size):
    lens = [1, 15, 16, 17, 100]
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=7)
    qs = full_queries(lens, num_heads, head_dim, torch.float32)
    q = torch.stack([qi[-1] for qi in qs])
    scale = 1 / math.sqrt(head_dim)
    out = paged_decode_attention_torch(q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, scale)
    for i in range(len(lens)):
        ref = dense_causal_attention(qs[i], case.keys[i], case.values[i], scale)[-1]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_decode_equals_single_token_prefill():
    lens = [3, 20, 9]
    case = make_paged_case(lens, 2, 16, block_size=4, seed=9)
    q = torch.randn(3, 4, 16)
    args = (case.k_cache, case.v_cache)
    decode = paged_decode_attention_torch(q, *args, case.context_lens, case.block_tables, 0.3)
    cu = torch.arange(4, dtype=torch.int32)
    prefill = paged_prefill_attention_torch(q, *args, cu, case.context_lens, case.block_tables, 0.3)
    torch.testing.assert_close(decode, prefill, atol=1e-6, rtol=1e-6)


def test_store_kvcache_writes_slots_and_skips_padding():
    cache_shape = (5, 4, 2, 8)  # 20 slots
    k_cache, v_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slot_mapping = torch.tensor([7, -1, 0, 19, -1, 12])
    store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping)
    flat_k, flat_v = k_cache.view(20, 2, 8), v_cache.view(20, 2, 8)
    written = slot_mapping >= 0
    torch.testing.assert_close(flat_k[slot_mapping[written]], k[written], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slot_mapping[written]], v[written], atol=0, rtol=0)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slot_mapping[written]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_store_then_attend_end_to_end_with_padding_slots():
    """The engine's order: store the step's K/V (padding rows -1), then attend through the tables."""
    lens, new = [12, 7], [5, 7]  # sequence 0 has a 7-token cached prefix
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, seed=11)
    qs = full_queries(lens, num_heads, head_dim, torch.float32)
    # Wipe the new tokens' slots, then write them back through store_kvcache with padding between.
    k_new, v_new, slots = [], [], []
    for i, n in enumerate(new):
        k_new += [case.keys[i][-n:], torch.full((2, num_kv_heads, head_dim), 1e4)]
        v_new += [case.values[i][-n:], torch.full((2, num_kv_heads, head_dim), 1e4)]
        slots += [case.slots[i][-n:], torch.tensor([-1, -1])]
        flat = case.slots[i][-n:]
        case.k_cache.view(-1, num_kv_heads, head_dim)[flat] = 0
        case.v_cache.view(-1, num_kv_heads, head_dim)[flat] = 0
    store_kvcache(torch.cat(k_new), torch.cat(v_new), case.k_cache, case.v_cache, torch.cat(slots))
    assert case.k_cache.abs().max() < 1e3  # padding rows were not written anywhere
    q = torch.cat([qi[-n:] for qi, n in zip(qs, new, strict=True)])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, scale)
    for i, n in enumerate(new):
        ref = dense_causal_attention(qs[i], case.keys[i], case.values[i], scale)[-n:]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_low_precision_inputs_keep_dtype_and_stay_close():
    lens = [30, 64]
    case = make_paged_case(lens, 2, 32, block_size=16, dtype=torch.bfloat16, seed=13)
    qs = full_queries(lens, 8, 32, torch.bfloat16)
    q = torch.stack([qi[-1] for qi in qs])
    scale = 1 / math.sqrt(32)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, scale)
    assert out.dtype == torch.bfloat16
    for i in range(len(lens)):
        ref = dense_causal_attention(qs[i], case.keys[i], case.values[i], scale)[-1]
        torch.testing.assert_close(out[i].float(), ref, atol=1e-2, rtol=1e-2)


def test_cpu_dispatches_to_the_torch_reference():
    assert attention_backend("cpu") == "torch"
    lens = [10, 3]
    case = make_paged_case(lens, 1, 16, block_size=4, seed=17)
    q = torch.randn(13, 2, 16)
    cu = torch.tensor([0, 10, 13], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, 0.25)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_torch(*args), atol=0, rtol=0)
