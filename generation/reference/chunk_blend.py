"""A slow, dense reference of chunk KV reuse with each recompute rule, and greedy decoding over its KV.

Independent of the engine's paged path (no block pool, no prefix cache, no re-rotation): a
reused chunk's canonical KV is a dense fp32 forward of `head ‖ chunk` whose pre-RoPE keys and
values are kept per layer; the request is one dense forward, layer by layer, in which the
positions that keep reused KV at a layer take the canonical keys and values (keys then rotated
directly at their new position). Which positions keep reused KV at which layer is the rule:

    None                 nothing reused: full prefill
    ChunkRecompute       the engine's rules: each reused chunk's first block, or its leading
                         fraction, is recomputed at every layer; the rest is reused at every layer
    DeviationSelection   CacheBlend: every token is computed up to the check layer; at the check
                         layer the reused tokens whose fresh key (or value) deviates most from the
                         canonical one are selected, and from there on only they are recomputed

Which tokens may be reused follows the engine's planner (`chunk_reuse.py`): the full blocks of
every chunk that starts on a block boundary after a block-aligned head, except a chunk right
after the head (an exact prefix) and the block holding the prompt's last token. Labels, the
suffix and the head are always computed (the head's KV equals the cached one exactly).

A position whose KV is reused at a layer still gets a query and an output in this dense pass,
but nothing reads them: later layers read only its (reused) keys and values, and the logits are
taken at the last prompt token, which is never reused. So the dense pass computes exactly the
approximation a sparse implementation would, at full-prefill cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from generation.engine.blend_selection import DeviationSelection, kv_deviation, select_top
from generation.engine.chunk_reuse import ChunkRecompute
from generation.engine.prompt_segments import PromptSegment, SegmentKind, prompt_token_ids, segment_starts
from generation.layers.rotary import apply_rotary
from generation.models.llama import LlamaForCausalLM

# Per layer: (keys, values), each [T, Hkv, D].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
RecomputeRule = ChunkRecompute | DeviationSelection | None


@dataclass
class BlendedPrefill:
    """A prompt's approximate prefill: what decoding needs and what the rule computed.

    Attributes:
        logits: [V] fp32 logits at the prompt's last token.
        kv: per layer, the prompt's pre-RoPE keys and values as attention read them, [T, Hkv, D].
        reusable: positions that could take reused KV (the rule's candidates and their first blocks).
        selected: per layer, positions among `reusable` computed fresh at that layer.
        num_head_tokens: the head's length (exact-cached in the engine, never computed).
    """

    logits: torch.Tensor
    kv: LayerKV
    reusable: list[int]
    selected: list[list[int]] = field(default_factory=list)
    num_head_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.kv[0][0].shape[0])

    def computed_share(self) -> float:
        """Token-layers computed after the head, over those of full prefill after the head.

        A token counts at a layer when its KV there is fresh. CacheBlend's check layer also
        projects every reused token's key (or value) to measure the deviation: that small extra
        is not counted.
        """
        after_head = self.num_tokens - self.num_head_tokens
        if after_head <= 0:
            return 0.0
        reused = [len(self.reusable) - len(sel) for sel in self.selected]
        return sum(after_head - r for r in reused) / (after_head * len(self.selected))


def reusable_ranges(segments: list[PromptSegment], block_size: int) -> list[tuple[int, int, int]]:
    """(segment index, start, end) of every chunk's tokens that may take reused KV (see the module doc)."""
    head_len = len(segments[0].token_ids)
    total = sum(len(s.token_ids) for s in segments)
    out = []
    for index, (start, segment) in enumerate(zip(segment_starts(segments), segments, strict=True)):
        n = len(segment.token_ids)
        if segment.kind is not SegmentKind.CHUNK or start == head_len or start % block_size or head_len % block_size:
            continue
        usable = min(n // block_size, (total - 1) // block_size - start // block_size)
        if usable > 0:
            out.append((index, start, start + usable * block_size))
    return out


class CanonicalKV:
    """Canonical per-layer pre-RoPE KV of `head ‖ chunk` (a dense forward), computed once per pair."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], LayerKV] = {}

    def rows(self, head: PromptSegment, chunk: PromptSegment) -> LayerKV:
        """Per layer (k pre-RoPE, v) of the chunk's tokens only, [len(chunk), Hkv, D]."""
        key = (head.token_ids, chunk.token_ids)
        if key not in self._cache:
            _, kv = dense_layers(self.model, [*head.token_ids, *chunk.token_ids], with_logits=False)
            n = len(head.token_ids)
            self._cache[key] = [(k[n:].clone(), v[n:].clone()) for k, v in kv]
        return self._cache[key]


@dataclass
class ReusedKV:
    """The prompt positions that may take reused KV, and that KV per layer (rows in position order)."""

    positions: torch.Tensor  # [R] int64, ascending
    layers: LayerKV  # per layer (k pre-RoPE, v), each [R, Hkv, D]

    @classmethod
    def none(cls, device: torch.device) -> ReusedKV:
        return cls(torch.empty(0, dtype=torch.int64, device=device), [])


@torch.no_grad()
def blended_prefill(
    model: LlamaForCausalLM,
    segments: list[PromptSegment],
    block_size: int,
    rule: RecomputeRule,
    canonical: CanonicalKV | None = None,
) -> BlendedPrefill:
    """The prompt's prefill under chunk reuse with `rule`, the slow way (see the module doc)."""
    canonical = canonical or CanonicalKV(model)
    device = model.model.embed_tokens.weight.device
    head = segments[0]
    positions: list[int] = []
    pieces: list[LayerKV] = []
    always_kept: list[int] = []  # ChunkRecompute: reused at every layer
    first_blocks: set[int] = set()
    if rule is not None:
        for index, begin, end in reusable_ranges(segments, block_size):
            rows = canonical.rows(head, segments[index])
            positions += range(begin, end)
            pieces.append([(k[: end - begin], v[: end - begin]) for k, v in rows])
            first_blocks.update(range(begin, min(end, begin + block_size)))
            if isinstance(rule, ChunkRecompute):
                # The engine's count is over the chunk's whole length (ChunkReusePlanner.plan).
                lead = rule.num_tokens(len(segments[index].token_ids), block_size)
                always_kept += range(begin + lead, end)
    reused = ReusedKV.none(device)
    if positions:
        layers = [
            (torch.cat([p[i][0] for p in pieces]), torch.cat([p[i][1] for p in pieces])) for i in range(len(pieces[0]))
        ]
        reused = ReusedKV(torch.tensor(positions, device=device), layers)
    selection = rule if isinstance(rule, DeviationSelection) else None
    pool = [p for p in positions if not (selection and selection.keep_first_block and p in first_blocks)]
    prefill = BlendedPrefill(torch.empty(0), [], positions, num_head_tokens=len(head.token_ids))
    logits, prefill.kv = dense_layers(model, prompt_token_ids(segments), reused, set(always_kept), selection, pool,
                                      prefill.selected)  # fmt: skip
    prefill.logits = logits.float()
    return prefill


@torch.no_grad()
def dense_layers(
    model: LlamaForCausalLM,
    ids: list[int],
    reused: ReusedKV | None = None,
    always_kept: set[int] | None = None,
    selection: DeviationSelection | None = None,
    pool: list[int] | None = None,
    selected_out: list[list[int]] | None = None,
    *,
    with_logits: bool = True,
) -> tuple[torch.Tensor, LayerKV]:
    """Logits [V] at the last token and per-layer pre-RoPE KV of a dense causal forward at positions 0..T-1.

    Positions in `always_kept` take their `reused` KV at every layer. With a selection, every
    position is fresh below its check layer; from there on the positions of `pool` that the
    check layer does not select take their reused KV. `selected_out` gets, per layer, the
    reused positions whose KV was fresh there. Without logits an empty tensor comes back.
    """
    inner = model.model
    device = inner.embed_tokens.weight.device
    reused = reused if reused is not None else ReusedKV.none(device)
    reused_positions = reused.positions.tolist()
    x = inner.embed_tokens(torch.tensor(ids, device=device)).float()
    positions = torch.arange(len(ids), device=device)
    cos, sin = inner.rotary_emb(positions[None], torch.float32)
    causal = positions[None, :] <= positions[:, None]
    # Which reused rows keep their reused KV at the current layer; CacheBlend changes it at its check layer.
    keep = torch.tensor([p in (always_kept or ()) for p in reused_positions], dtype=torch.bool, device=device)
    kept: LayerKV = []
    for layer_index, layer in enumerate(inner.layers):
        q, k, v = _qkv(layer, x)
        if selection is not None and layer_index == selection.check_layer:
            keep = _unselected(selection, pool or [], reused, k, v, layer_index)
        if selected_out is not None:
            fresh_rows = zip(reused_positions, keep.tolist(), strict=True)
            selected_out.append([p for p, reused_here in fresh_rows if not reused_here])
        if reused_positions:
            rows_k, rows_v = reused.layers[layer_index]
            where = reused.positions[keep]
            k[where], v[where] = rows_k[keep], rows_v[keep]
        kept.append((k.clone(), v.clone()))
        qr, kr = apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        out = _attention(layer.self_attn, qr, kr, v.transpose(0, 1)[None], causal)
        x = x + layer.self_attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    if not with_logits:
        return torch.empty(0), kept
    # Only the last token's logits: the LM head over every position would cost a tenth of the pass.
    return model.compute_logits(inner.norm(x[-1:]))[0], kept


def _unselected(
    rule: DeviationSelection, pool: list[int], reused: ReusedKV, k: torch.Tensor, v: torch.Tensor, layer_index: int
) -> torch.Tensor:
    """Per reused row, whether it keeps its reused KV from the check layer on: the pool but its top deviations."""
    keep = torch.zeros(len(reused.positions), dtype=torch.bool, device=k.device)
    if not pool:
        return keep
    in_pool = torch.isin(reused.positions, torch.tensor(pool, device=k.device))
    rows = in_pool.nonzero()[:, 0]
    where = reused.positions[rows]
    rows_k, rows_v = reused.layers[layer_index]
    deviation = kv_deviation((k[where], v[where]), (rows_k[rows], rows_v[rows]), rule.deviation_of)
    keep[rows] = True
    keep[rows[select_top(deviation, rule.num_selected(len(rows)))]] = False
    return keep


def _qkv(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Pre-RoPE q [T, Hq, D], k and v [T, Hkv, D] of a decoder layer's attention for hidden states x."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(len(x), attn.num_heads, attn.head_dim)
    k = k.view(len(x), attn.num_kv_heads, attn.head_dim).clone()
    v = v.view(len(x), attn.num_kv_heads, attn.head_dim).clone()
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Attention of q [1, Hq, Tq, D] over k, v [1, Hkv, Tk, D] under a boolean mask [Tq, Tk]; [Tq, Hq * D]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).reshape(q.shape[2], attn.q_size)


@torch.no_grad()
def greedy_continue(
    model: LlamaForCausalLM, prefill: BlendedPrefill, max_tokens: int, eos_token_ids: set[int]
) -> list[int]:
    """Greedy answer tokens after the prefill (a stop token included, as the engine reports them).

    Each new token is computed fresh against the prompt's approximate KV and the answer's own.
    """
    inner = model.model
    device = inner.embed_tokens.weight.device
    positions = torch.arange(prefill.num_tokens, device=device)
    cos, sin = inner.rotary_emb(positions[None], torch.float32)
    # The prompt's keys rotated at their positions once; each new token's key is appended rotated.
    kv = [(_rotate_keys(k, cos, sin), v.clone()) for k, v in prefill.kv]
    token = int(prefill.logits.argmax())
    out = [token]
    while token not in eos_token_ids and len(out) < max_tokens:
        position = torch.tensor([kv[0][0].shape[0]], device=device)
        cos, sin = inner.rotary_emb(position[None], torch.float32)
        x = inner.embed_tokens(torch.tensor([token], device=device)).float()
        for layer_index, layer in enumerate(inner.layers):
            q, k, v = _qkv(layer, x)
            qr, kr = apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            past_k, past_v = kv[layer_index]
            past_k = torch.cat((past_k, kr[0].transpose(0, 1)))
            past_v = torch.cat((past_v, v))
            kv[layer_index] = (past_k, past_v)
            visible = torch.ones(1, past_k.shape[0], dtype=torch.bool, device=device)
            out_attn = _attention(
                layer.self_attn, qr, past_k.transpose(0, 1)[None], past_v.transpose(0, 1)[None], visible
            )
            x = x + layer.self_attn.o_proj(out_attn)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        token = int(model.compute_logits(inner.norm(x))[-1].argmax())
        out.append(token)
    return out


def _rotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys [T, Hkv, D] rotated at positions 0..T-1 (tables [1, 1, T, D])."""
    kt = k.transpose(0, 1)[None]
    return apply_rotary(kt, kt, cos, sin)[1][0].transpose(0, 1)
