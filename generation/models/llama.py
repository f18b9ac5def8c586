"""The Llama architecture (also Qwen2 with q/k/v biases, Qwen3 with QK-norm) in plain torch, over a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from generation.config import ModelConfig
from generation.layers.attention import AttentionMetadata, KVCache, dense_causal_attention, paged_attention
from generation.layers.fp8 import FP8_DTYPE, Fp8Linear, Fp8Rows, quantize_weight
from generation.layers.kernel_choice import triton_fused_for
from generation.layers.linear import Linear
from generation.layers.norm import RMSNorm
from generation.layers.rotary import RopeInputs, RotaryEmbedding, apply_rotary

# Checkpoint names that we load into one fused matrix: fewer, larger matmuls per layer, which
# matters on CPU where per-op overhead dominates decode. Value: (fused name, shard index).
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# The decoder's linear layers that quantization="fp8" runs in e4m3 (the LM head and the embedding
# stay in the model dtype, as the published FP8-dynamic checkpoints keep them).
FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Checkpoint tensors of an FP8 checkpoint that the engine does not load: static activation scales
# (activations are quantized per token as they arrive, which needs no scale).
IGNORED_SUFFIXES = (".input_scale",)
# Per-layer KV cache scales of FP8 checkpoints: compressed-tensors' kv_cache_scheme names them
# self_attn.k_scale / v_scale, AutoFP8 k_proj.output_scale / v_proj.output_scale. Value: K (0) or V (1).
KV_SCALE_SUFFIXES = {".self_attn.k_scale": 0, ".self_attn.v_scale": 1,
                     ".self_attn.k_proj.output_scale": 0, ".self_attn.v_proj.output_scale": 1}


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, optional QK-norm, rotary embeddings and grouped KV heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Qwen2 has biases on q/k/v only; Llama's (and Qwen3's) attention_bias covers o_proj too.
        o_bias = config.attention_bias and config.model_type != "qwen2"
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        rope: RopeInputs,
        meta: AttentionMetadata | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x: [T, H] packed tokens (with meta and cache; maybe quantized by the norm) or [B, S, H] whole rows."""
        lead = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if meta is None:
            # Dense rows: heads before the sequence axis, as the rotary tables [B, 1, S, D] expect.
            assert rope.tables is not None
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary(q, k, *rope.tables)
            out = dense_causal_attention(q, k, v, self.scale).transpose(1, 2)  # [B, S, Hq, D]
        else:
            assert kv_cache is not None, "a paged step needs this layer's KV cache"
            out = paged_attention(q, k, v, rope, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(*lead, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, Fp8Linear) and self.down_proj.takes_quantized_input(gate_up):
            from generation.layers import triton_fp8_fused

            return self.down_proj(triton_fp8_fused.silu_and_mul_quant(gate_up))
        fused = triton_fused_for(gate_up)
        if fused is not None:
            lead = gate_up.shape[:-1]
            act = fused.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*lead, self.intermediate_size)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block, both residual.

    The residual stream is passed along separately and added at the start of the next norm, so
    that one fused kernel does add and norm (the sums are the same as adding after each block).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        meta: AttentionMetadata | None,
        kv_cache: KVCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): their sum is the layer's output.

        `residual` is None for the first layer, whose x is the embedding itself.
        """
        h, residual = _pre_norm(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        h = self.self_attn(h, rope, meta, kv_cache)
        h, residual = _pre_norm(self.post_attention_layernorm, h, residual, self.mlp.gate_up_proj)
        return self.mlp(h), residual


def _pre_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) without a residual; quantized per token
    in the norm's own kernel when `consumer` is an FP8 layer that would quantize it anyway."""
    if (isinstance(consumer, Fp8Linear) and consumer.takes_quantized_input(x) and x.stride(-1) == 1
            and (residual is None or residual.is_contiguous())):
        from generation.layers import triton_fp8_fused

        rows, summed = triton_fp8_fused.rms_norm_quant(x, norm.weight, norm.eps, residual)
        return rows, x if summed is None else summed
    if residual is None:
        return norm(x), x
    return norm.add_and_norm(x, residual)


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One table per forward for all layers, instead of recomputing it in each layer.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | None,
        kv_caches: list[KVCache] | None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if meta is not None and triton_fused_for(x) is not None:
            # The fused rotary kernel looks each position up in a table built once.
            rope = RopeInputs(positions, cos_sin=self.rotary_emb.cos_sin_table(x.dtype))
        else:
            rope = RopeInputs(positions, tables=self.rotary_emb(positions, x.dtype))
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, meta, kv_caches[i] if kv_caches is not None else None)
        if residual is None:  # no layers at all
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; names match Hugging Face checkpoints except the fused projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # [layers, 2] fp32 K and V scales for an FP8 KV cache, when the checkpoint carries them.
        self.kv_cache_scales: torch.Tensor | None = None

    @classmethod
    def create_empty(
        cls, config: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str | None = None
    ) -> LlamaForCausalLM:
        """A model with uninitialised parameters on `device`, ready for `load_weights`.

        Built on the meta device first: random initialisation of weights that are about to be
        overwritten costs seconds on CPU and memory on GPU. With quantization="fp8" the decoder's
        linear layers are swapped for Fp8Linear there too, so their bf16 weights never exist on
        the device (a 70B model's would not fit).
        """
        with torch.device("meta"):
            model = cls(config).to(dtype)
            if quantization == "fp8":
                model._swap_fp8_linears(dtype)
        model = model.to_empty(device=device)
        model.model.rotary_emb.reset_inv_freq()  # to_empty left it uninitialised, .to() cast it
        return model.eval()

    def _swap_fp8_linears(self, dtype: torch.dtype) -> None:
        for layer in self.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name in FP8_LINEARS:
                    old = getattr(parent, name, None)
                    if isinstance(old, Linear):
                        new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, dtype)
                        setattr(parent, name, new)

    def fill_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights on the model's device (load_format="dummy"): normal(0, std), norms at 1.

        FP8 layers are filled a slice of rows at a time and quantized in place, so no full-size
        bf16 copy of a layer is ever made. Tied embeddings are tied as load_weights ties them.
        """
        gen = torch.Generator(device=self.model.embed_tokens.weight.device).manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Fp8Linear):
                    w = module.weight
                    step = max(1, (1 << 26) // w.shape[1])
                    for start in range(0, w.shape[0], step):
                        rows = w[start : start + step]
                        block = torch.randn(rows.shape, generator=gen, device=w.device, dtype=torch.float32) * std
                        q, scale = quantize_weight(block)
                        rows.copy_(q)
                        module.weight_scale[start : start + step].copy_(scale)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)
                else:
                    for p in module.parameters(recurse=False):
                        p.normal_(0.0, std, generator=gen)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
        kv_caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """Hidden states of a step.

        Two forms: packed tokens input_ids [T] with positions [T], `meta` and one KV cache per
        layer (the engine's paged step), returning [T, H]; or whole unpadded rows input_ids
        [B, S] without meta or cache (positions 0..S-1 by default), returning [B, S, H]: a plain
        causal forward, the form the parity tests compare against Hugging Face.
        """
        if meta is None:
            assert input_ids.dim() == 2 and kv_caches is None, "a cache-free forward takes whole rows [B, S]"
            if positions is None:
                batch, seq_len = input_ids.shape
                positions = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
        else:
            assert input_ids.dim() == 1 and positions is not None and kv_caches is not None
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of hidden states [..., H], written into `out` ([N, V], for 2-D hidden) when given."""
        return self.lm_head(hidden, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing packed ones.

        Raises:
            KeyError: a checkpoint tensor has no matching parameter.
            ValueError: a shape mismatch, or parameters the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        kv_scales: dict[tuple[int, int], float] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.endswith(IGNORED_SUFFIXES):
                continue  # derived from the config (some old checkpoints store it); static activation scales
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the head is the embedding matrix
            kv = self._kv_scale_slot(name)
            if kv is not None:
                kv_scales[kv] = float(tensor.float().reshape(-1)[0])
                continue
            target, shard = self._param_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in this model")
            param = params[target]
            dest = param.data if shard is None else self._shard(target, param.data, shard)
            if target.endswith(".weight_scale"):
                # Per-channel ([N] or [N, 1]) or per-tensor ([] or [1], broadcast to the rows).
                flat = tensor.reshape(-1)
                if flat.numel() not in (1, dest.numel()):
                    raise ValueError(f"{name}: {flat.numel()} scales for {dest.numel()} output channels")
                dest.copy_(flat.float().expand(dest.numel()) if flat.numel() == 1 else flat)
            elif dest.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                # A bf16/fp32 checkpoint loaded with quantization="fp8": quantized here, per output channel.
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                q, scale = quantize_weight(tensor.to(dest.device))
                dest.copy_(q)
                scale_target = target.removesuffix(".weight") + ".weight_scale"
                scale_param = params[scale_target].data
                (scale_param if shard is None else self._shard(scale_target, scale_param, shard)).copy_(scale)
                loaded.add(scale_target if shard is None else f"{scale_target}#{shard}")
            elif tensor.dtype == FP8_DTYPE and dest.dtype != FP8_DTYPE:
                raise ValueError(
                    f"{name} is FP8 in the checkpoint but this model's parameter is {dest.dtype}: "
                    'load FP8 checkpoints with quantization="fp8"'
                )
            else:
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self.kv_cache_scales = self._kv_scale_table(kv_scales)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            params.pop("lm_head.weight", None)
        missing = sorted(n for n in self._expected_names(params) if n not in loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{len(missing)} weights missing from the checkpoint: {shown}")

    @staticmethod
    def _kv_scale_slot(name: str) -> tuple[int, int] | None:
        """(layer, 0 for K / 1 for V) of a checkpoint's KV cache scale tensor, else None."""
        for suffix, kind in KV_SCALE_SUFFIXES.items():
            if name.endswith(suffix) and name.startswith("model.layers."):
                return int(name.split(".")[2]), kind
        return None

    def _kv_scale_table(self, scales: dict[tuple[int, int], float]) -> torch.Tensor | None:
        """[layers, 2] fp32 KV cache scales (K, V) from the checkpoint, or None when it has none.

        Raises:
            ValueError: the checkpoint gives scales for some layers but not all.
        """
        if not scales:
            return None
        layers = self.config.num_hidden_layers
        missing = [(i, j) for i in range(layers) for j in range(2) if (i, j) not in scales]
        if missing:
            raise ValueError(f"the checkpoint has KV cache scales for some layers but not for {missing[:4]}")
        table = torch.tensor([[scales[(i, 0)], scales[(i, 1)]] for i in range(layers)], dtype=torch.float32)
        return table.to(self.model.embed_tokens.weight.device)

    @staticmethod
    def _param_name(name: str) -> tuple[str, int | None]:
        for ckpt_name, (fused, shard) in PACKED_MODULES.items():
            if f".{ckpt_name}." in name:
                return name.replace(ckpt_name, fused), shard
        return name, None

    def _shard(self, target: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        # The rows of a fused matrix are [q | k | v] or [gate | up]; return the view of one part.
        c = self.config
        if ".qkv_proj." in target:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            bounds = [0, q, q + kv, q + 2 * kv]
        else:
            bounds = [0, c.intermediate_size, 2 * c.intermediate_size]
        return data[bounds[shard] : bounds[shard + 1]]

    @staticmethod
    def _expected_names(params: dict[str, nn.Parameter]) -> list[str]:
        names = []
        for name in params:
            if ".qkv_proj." in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names
