"""A slow reference of chunk KV reuse (KV-REUSE.md B6): dense fp32 layers, explicit positions, no cache.

Independent of the engine's paged path: each reused chunk's canonical KV is a dense forward of
`head ‖ chunk` whose pre-RoPE keys and values are kept per layer; the request is then one dense
causal forward in which, at every layer, the filled positions' keys and values are replaced by
the canonical ones (keys rotated directly at the new position, not re-rotated). Queries of filled
positions are computed but never read by anything that matters: attention reads only K and V.
"""

from __future__ import annotations

import math

import torch

from generation.engine.prompt_segments import PromptSegment, SegmentKind, prompt_token_ids, segment_starts
from generation.layers.attention import dense_causal_attention
from generation.layers.rotary import apply_rotary
from generation.models.llama import LlamaForCausalLM

# Per layer: (pre-RoPE keys, values), each [T, Hkv, D].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def dense_forward(
    model: LlamaForCausalLM, ids: list[int], overrides: dict[int, tuple[LayerKV, int]] | None = None
) -> tuple[torch.Tensor, LayerKV]:
    """Logits [T, V] and per-layer pre-RoPE K, V of a causal forward over ids at positions 0..T-1.

    overrides: position -> (canonical per-layer KV, row in it) whose K, V replace that position's.
    """
    inner = model.model
    device = inner.embed_tokens.weight.device
    x = inner.embed_tokens(torch.tensor(ids, device=device)).float()
    positions = torch.arange(len(ids), device=device)
    cos, sin = inner.rotary_emb(positions[None], torch.float32)  # [1, 1, T, D]
    kept: LayerKV = []
    for layer_index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(len(ids), attn.num_heads, attn.head_dim)
        k = k.view(len(ids), attn.num_kv_heads, attn.head_dim).clone()
        v = v.view(len(ids), attn.num_kv_heads, attn.head_dim).clone()
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        for pos, (canonical, row) in (overrides or {}).items():
            k[pos], v[pos] = canonical[layer_index][0][row], canonical[layer_index][1][row]
        kept.append((k.clone(), v.clone()))
        qr, kr = apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        out = dense_causal_attention(qr, kr, v.transpose(0, 1)[None], attn.scale)[0].transpose(0, 1)
        x = x + attn.o_proj(out.reshape(len(ids), attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(inner.norm(x)), kept


def filled_ranges(
    segments: list[PromptSegment], block_size: int, mode: str = "first_block", fraction: float = 0.15
) -> list[tuple[int, int, int]]:
    """(chunk index, fill start, fill end) per reused chunk, by the rule the engine documents.

    A chunk's full blocks are reused except its recomputed leading tokens (its first block, or the
    leading ceil(fraction * n) tokens) and any block holding the prompt's last token. A chunk right
    after the head is an exact prefix: nothing to fill.
    """
    head_len = len(segments[0].token_ids)
    total = sum(len(s.token_ids) for s in segments)
    out = []
    for index, (start, segment) in enumerate(zip(segment_starts(segments), segments, strict=True)):
        n = len(segment.token_ids)
        if segment.kind is not SegmentKind.CHUNK or start == head_len or start % block_size or head_len % block_size:
            continue
        recompute = min(n, block_size) if mode == "first_block" else max(1, min(n, math.ceil(fraction * n)))
        usable = min(n // block_size, (total - 1) // block_size - start // block_size)
        begin, end = start + recompute, start + usable * block_size
        if end > begin:
            out.append((index, begin, end))
    return out


def reference_logits(
    model: LlamaForCausalLM, segments: list[PromptSegment], block_size: int, **recompute: object
) -> torch.Tensor:
    """Logits [V] at the prompt's last token under chunk reuse, computed the slow way."""
    head = list(segments[0].token_ids)
    starts = segment_starts(segments)
    overrides: dict[int, tuple[LayerKV, int]] = {}
    for index, begin, end in filled_ranges(segments, block_size, **recompute):  # type: ignore[arg-type]
        _, canonical = dense_forward(model, head + list(segments[index].token_ids))
        for pos in range(begin, end):
            overrides[pos] = (canonical, len(head) + pos - starts[index])
    logits, _ = dense_forward(model, prompt_token_ids(segments), overrides)
    return logits[-1]
