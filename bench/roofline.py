"""The decode roofline: the bytes one decode step must read, and the bandwidth to read them at.

An honest decode floor divides the bytes a step streams by the read bandwidth of a large
read-only kernel measured in the same run:

- weights: every parameter once (tied parameters deduplicated), except the input embedding,
  of which decode reads one row per token; when the LM head is tied to the embedding the head
  streams the whole matrix, so it counts once then. Bytes are `numel * element_size` of the real
  parameters, so FP8 weights (e4m3, 1 byte) and their fp32 per-channel scales count as stored;
- the KV cache the step attends over: context × layers × 2 (K and V) × KV heads × head dim ×
  KV bytes per element, for every sequence of the batch.

The old floor (all weight bytes / device-to-device copy bandwidth) is kept for reference:
`DecodeFloor.old_and_honest` prints both in one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from generation.config import ModelConfig

GIB = 1024**3
EMBEDDING_NAME = "model.embed_tokens.weight"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device | str, gib: float = 8, reps: int = 10) -> float:
    """Read bandwidth in bytes/s of `torch.sum` over a `gib` GiB fp32 tensor, best of `reps`.

    A reduction reads every byte once and writes one number: the rate a decode step's weight
    and KV streaming can at best reach on this device.
    """
    device = torch.device(device)
    x = torch.ones(int(gib * GIB) // 4, dtype=torch.float32, device=device)
    n_bytes = x.numel() * x.element_size()
    x.sum()  # warm-up (kernel selection, first-touch pages on CPU)
    best = 0.0
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = max(best, n_bytes / (time.perf_counter() - t))
    del x
    return best


def copy_bandwidth(device: torch.device | str, gib: float = 2, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), best of `reps`."""
    device = torch.device(device)
    x = torch.ones(int(gib * GIB), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = 0.0
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = max(best, 2 * x.numel() / (time.perf_counter() - t))
    del x, y
    return best


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step reads, in bytes.

    streamed_weight_bytes: weights the step reads in full (the embedding excluded unless tied).
    embedding_row_bytes: the embedding rows of the step's tokens (one per sequence).
    kv_bytes: the KV cache the step attends over.
    all_weight_bytes: every parameter once (what the old floor counted).
    embedding_bytes: the input embedding matrix; embedding_tied: whether the LM head is it.
    """

    streamed_weight_bytes: int
    embedding_row_bytes: int
    kv_bytes: int
    all_weight_bytes: int
    embedding_bytes: int
    embedding_tied: bool

    @property
    def total(self) -> int:
        """Bytes the step must read: streamed weights, the embedding rows and the KV cache."""
        return self.streamed_weight_bytes + self.embedding_row_bytes + self.kv_bytes


def model_on_meta(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None
) -> nn.Module:
    """The engine's model of `config` on the meta device (no memory), in `dtype`.

    With quantization="fp8" every linear layer of the decoder layers (q/k/v/o, gate/up/down) is
    an `Fp8Linear` (e4m3 weight, fp32 per-channel scale), as the engine builds it; the embedding,
    LM head and norms stay in `dtype`. The LM head is tied to the embedding when the config says so.
    """
    from generation.models.llama import LlamaForCausalLM

    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization {quantization!r}: only None and 'fp8' are known")
    # The engine's own construction (the same layers swapped for Fp8Linear), left on the meta device.
    model = LlamaForCausalLM.create_empty(config, torch.device("meta"), dtype, quantization=quantization)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _unique_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) once per distinct parameter: by identity, then by storage address (not on meta)."""
    seen_ids: set[int] = set()
    seen_ptrs: set[tuple[str, int]] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen_ids:
            continue
        seen_ids.add(id(p))
        if p.device.type != "meta":
            key = (str(p.device), p.data_ptr())
            if key in seen_ptrs:
                continue
            seen_ptrs.add(key)
        out.append((name, p))
    return out


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.device.type != "meta" and a.device == b.device and a.data_ptr() == b.data_ptr()


def decode_bytes(
    model_config_or_module: ModelConfig | nn.Module,
    context_len: int,
    batch: int = 1,
    kv_dtype_bytes: int = 2,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quantization: str | None = None,
) -> DecodeBytes:
    """Bytes one decode step of `batch` sequences, each attending over `context_len` tokens, reads.

    Counted from the parameters of a model (`LlamaForCausalLM`, e.g. `LLM.model`), or, given a
    ModelConfig, of the engine's model built on the meta device in `dtype` with `quantization`
    (those two are ignored for a module). KV bytes: context_len × layers × 2 × kv_heads ×
    head_dim × kv_dtype_bytes × batch.
    """
    if isinstance(model_config_or_module, nn.Module):
        model = model_config_or_module
    else:
        model = model_on_meta(model_config_or_module, dtype, quantization)
    config = model.config  # type: ignore[attr-defined]
    embedding = model.model.embed_tokens.weight  # type: ignore[union-attr]
    head = getattr(model, "lm_head", None)
    tied = head is not None and _same_tensor(head.weight, embedding)
    all_bytes = streamed = 0
    for _name, p in _unique_parameters(model):
        n = p.numel() * p.element_size()
        all_bytes += n
        if _same_tensor(p, embedding) and not tied:
            continue
        streamed += n
    embedding_bytes = embedding.numel() * embedding.element_size()
    row_bytes = 0 if tied else batch * embedding.shape[1] * embedding.element_size()
    kv = context_len * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
    return DecodeBytes(
        streamed_weight_bytes=streamed,
        embedding_row_bytes=row_bytes,
        kv_bytes=kv * kv_dtype_bytes * batch,
        all_weight_bytes=all_bytes,
        embedding_bytes=embedding_bytes,
        embedding_tied=tied,
    )


def matmul_parameters(model_config_or_module: ModelConfig | nn.Module) -> tuple[int, int]:
    """(parameters of the decoder layers' matmul weights, parameters of the LM head).

    The weights every prompt token multiplies by (2 FLOPs per parameter), and the head, which a
    prefill runs for the sampled (last) token of a prompt only. Norm vectors and FP8 scales are
    not matmul weights.
    """
    model = (
        model_config_or_module
        if isinstance(model_config_or_module, nn.Module)
        else model_on_meta(model_config_or_module)
    )
    layers = sum(p.numel() for _, p in _unique_parameters(model.model.layers) if p.dim() >= 2)  # type: ignore[union-attr]
    head = model.lm_head.weight.numel()  # type: ignore[union-attr]
    return layers, head


PREFILL_FLOPS_FORMULA = (
    "FLOPs per prompt = 2 × P_layers × L + 2 × P_head + 2 × layers × heads × head_dim × L² "
    "(matmul weights of the decoder layers per token, the LM head once for the sampled token, "
    "causal attention: QKᵀ and PV, 4 × layers × heads × head_dim × L/2 per token on average)"
)


def prefill_flops(model_config_or_module: ModelConfig | nn.Module, prompt_len: int) -> float:
    """FLOPs of prefilling one prompt of prompt_len tokens and sampling its next token (PREFILL_FLOPS_FORMULA)."""
    layers_params, head_params = matmul_parameters(model_config_or_module)
    c = (
        model_config_or_module.config  # type: ignore[union-attr]
        if isinstance(model_config_or_module, nn.Module)
        else model_config_or_module
    )
    attention = 2.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * prompt_len**2
    return 2.0 * layers_params * prompt_len + 2.0 * head_params + attention


@dataclass(frozen=True)
class DecodeFloor:
    """The least time a decode step can take: `bytes` read at `bandwidth` bytes/s."""

    bytes: int
    bandwidth: float
    label: str = "streamed"
    bandwidth_label: str = "read"

    @property
    def ms(self) -> float:
        """The floor in milliseconds."""
        return self.bytes / self.bandwidth * 1e3

    def describe(self) -> str:
        """'15.04 GB streamed / 4.24 TB/s read = 3.55 ms' (smaller units for tiny models and CPUs)."""
        ms = f"{self.ms:.2f} ms" if self.ms >= 0.1 else f"{self.ms * 1e3:.2f} µs"
        return f"{si(self.bytes, 'B')} {self.label} / {si(self.bandwidth, 'B/s')} {self.bandwidth_label} = {ms}"

    @staticmethod
    def old_and_honest(counted: DecodeBytes, read_bw: float, copy_bw: float) -> tuple[DecodeFloor, DecodeFloor]:
        """(old floor: all weights / copy bandwidth, honest floor: bytes the step reads / read bandwidth)."""
        old = DecodeFloor(counted.all_weight_bytes, copy_bw, label="all weights", bandwidth_label="copy")
        return old, DecodeFloor(counted.total, read_bw)

    @staticmethod
    def comparison_line(old: DecodeFloor, honest: DecodeFloor) -> str:
        """'old floor: all weights / copy bandwidth = X ms; honest floor: Y GB streamed / Z TB/s read = W ms'."""
        return (
            f"old floor: all weights / copy bandwidth = {old.ms:.2f} ms ({old.describe()}); "
            f"honest floor: {honest.describe()}"
        )


def si(value: float, unit: str) -> str:
    """'15.04 GB', '4.24 TB/s', '812.00 kB': two decimals in the largest decimal prefix below the value."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def percent_of_floor(floor_ms: float, measured_ms: float) -> float:
    """How close a measured step is to the floor: 100 × floor / measured."""
    return 100.0 * floor_ms / measured_ms
