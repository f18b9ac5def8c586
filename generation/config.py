"""ModelConfig (architecture read from a model folder) and EngineConfig (how the engine runs it)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from generation.engine.limits import check_engine_limits
from rag.errors import ModelError

if TYPE_CHECKING:
    import torch

    from generation.engine.chunk_reuse import ChunkRecompute

logger = logging.getLogger(__name__)

# Mistral is the Llama architecture (no attention biases, head_dim may be set) plus an optional
# sliding window, which the engine honours by capping the context at the window (context_len).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, independent of the transformers version."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    # Qwen3: RMSNorm over each query and key head before rotary embeddings.
    qk_norm: bool = False
    # rope_type and its parameters (factor, low_freq_factor, ...); {"rope_type": "default"} if none
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    # EOS ids from config.json and generation_config.json (the tokenizer's is added by the LLM).
    eos_token_ids: tuple[int, ...] = ()
    # Mistral: each token attends to the last `sliding_window` positions (itself included); None
    # is full attention (Mistral v0.3, and every other model type here).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; valid: {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; valid: {SUPPORTED_ROPE_TYPES}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def context_len(self) -> int:
        """Most tokens of one sequence that the engine computes exactly.

        max_position_embeddings, or the sliding window when that is smaller: the engine's
        attention is full, and within the window sliding-window attention is the same thing
        (HF masks key j for query i when i - j >= sliding_window, which never happens while
        i < sliding_window).
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelConfig:
        """Read config.json (and generation_config.json) through transformers' AutoConfig.

        AutoConfig fills in the class defaults that config.json may omit (rms_norm_eps,
        rope_theta, tie_word_embeddings, ...), which raw JSON would not.

        Raises:
            ModelError: the folder has no readable config or an architecture we do not implement.
        """
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(model_dir))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(
                f"cannot read the model config in {model_dir}: {exc}. "
                "Pass a Hugging Face model folder with a valid config.json."
            ) from exc
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"the model in {model_dir} is a {hf.model_type!r} model; this generator implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. Use such a model, or serve this one through a "
                "remote generator (vLLM, SGLang)."
            )
        if getattr(hf, "use_sliding_window", False):
            logger.warning("%s: sliding-window attention is not implemented; attention is full", model_dir)
        try:
            return cls(
                model_type=hf.model_type,
                vocab_size=hf.vocab_size,
                hidden_size=hf.hidden_size,
                intermediate_size=hf.intermediate_size,
                num_hidden_layers=hf.num_hidden_layers,
                num_attention_heads=hf.num_attention_heads,
                num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                rms_norm_eps=float(hf.rms_norm_eps),
                max_position_embeddings=hf.max_position_embeddings,
                rope_theta=_rope_theta(hf),
                tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama only when attention_bias is set.
                attention_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
                mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                qk_norm=hf.model_type == "qwen3",
                rope_scaling=_rope_scaling(hf),
                eos_token_ids=tuple(_eos_ids(getattr(hf, "eos_token_id", None)) + _generation_eos_ids(model_dir)),
                # Only Mistral's: Qwen2 configs carry a sliding_window that applies only with
                # use_sliding_window (warned about above).
                sliding_window=getattr(hf, "sliding_window", None) if hf.model_type == "mistral" else None,
            )
        except ValueError as exc:
            raise ModelError(
                f"the model in {model_dir} cannot run on this generator: {exc}. "
                "Use a Llama, Mistral, Qwen2 or Qwen3 architecture model, or serve it through a remote generator."
            ) from exc


def _rope_params(hf: Any) -> dict[str, Any]:
    # transformers >= 5 keeps theta and scaling together in `rope_parameters`; 4.x has
    # `rope_theta` plus an optional `rope_scaling` dict whose type key was once "type".
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    return dict(params)


def _rope_theta(hf: Any) -> float:
    params = _rope_params(hf)
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _rope_scaling(hf: Any) -> dict[str, Any]:
    params = _rope_params(hf)
    params.pop("rope_theta", None)
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _generation_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return []
    return _eos_ids(data.get("eos_token_id"))


DTYPE_NAMES = ("float32", "float16", "bfloat16")
# Weight quantization (EngineConfig.quantization): None keeps the checkpoint's dtype; "fp8" runs
# the decoder's linear layers in e4m3 (a bf16 checkpoint is quantized at load, an FP8 checkpoint
# is loaded as it is).
QUANTIZATION_CHOICES = ("fp8",)
# KV cache storage (EngineConfig.kv_cache_dtype): "auto" is the model's dtype, "fp8" is e4m3.
KV_CACHE_DTYPES = ("auto", "fp8")
# Where the weights come from (EngineConfig.load_format): "auto" reads the folder's safetensors;
# "dummy" fills random weights straight on the device from config.json alone (benchmarks of big
# shapes: no checkpoint on disk, and with quantization="fp8" no bf16 copy ever exists).
LOAD_FORMATS = ("auto", "dummy")
KV_REUSE_MODES = ("exact", "chunks")
# What a request does with a chunk whose canonical KV is not cached (EngineConfig.chunk_miss).
CHUNK_MISS_CHOICES = ("wait", "in_place")
# Steps per scheduled batch on CUDA: the host's per-batch work (schedule, pack, sync, finish
# checks) is then paid once per 8 tokens, while a new request waits at most 8 steps to join.
DEFAULT_CUDA_SCHEDULER_STEPS = 8


@dataclass(frozen=True)
class EngineConfig:
    """How the generation engine runs a model: batch limits, KV cache size, CUDA graphs.

    Args:
        max_num_seqs: most requests holding KV blocks at once (the decode batch). Range >= 1.
        max_num_batched_tokens: most tokens fed to the model in one step (prefill chunks plus one
            per decode); also the size of the start-up profiling pass. Range >= max_num_seqs.
        max_model_len: most tokens of one request (prompt + output). None takes the model's
            context, lowered (with a warning) to what the KV cache holds. A value given here must
            fit the model's context and the KV cache, or the engine refuses to start. Range >= 2,
            and <= max_num_batched_tokens without chunked prefill.
        block_size: tokens per KV block. Range 1..256; 16 is usual, Triton kernels like powers of 2.
        gpu_memory_utilization: share of the GPU's total memory that weights, activations and the
            KV cache may use together (CUDA only). Range (0, 1].
        num_kv_blocks: KV blocks to allocate, overriding the measurement (tests, CPU). Range >= 1.
        enable_prefix_caching: share full KV blocks between requests with the same prefix (and
            namespace).
        enable_chunked_prefill: split long prompts over steps so that decodes keep running.
            Without it every prompt must fit in one step (max_num_batched_tokens).
        enforce_eager: no CUDA graphs (debugging; always eager on CPU).
        num_scheduler_steps: most model steps per scheduled batch: when every request in a step
            samples, the batch goes on decoding on the device, each step fed the last one's tokens,
            and the host schedules, syncs and post-processes once per batch (tokens then reach
            streams in bursts). A batch stops early when every request in it ended, or when the
            caller of `LLMEngine.step` says a request is waiting (the service does): a new request
            then waits a step or two to join, not the whole batch. None gives 8 on CUDA, where it
            hides the host's per-step work, and 1 on CPU. Range >= 1.
        dtype: "float32", "float16", "bfloat16" (or the torch dtype); None gives bf16 on CUDA
            and fp32 on CPU.
        device: "cuda", "cuda:1", "cpu"; None picks CUDA when available.
        kv_reuse: how segmented prompts (`LLMEngine.add_segmented_request`) reuse KV. "exact":
            only exact prefixes, bit for bit what full prefill computes. "chunks": a chunk's KV
            is computed once after the shared head and reused at any position in later prompts
            (re-rotated; an approximation, see docs/benchmarks.md for its quality), the labels,
            each reused chunk's first tokens and the question recomputed. Needs prefix caching
            and a RoPE scheme with fixed frequencies (default, linear, llama3).
        chunk_recompute: in "chunks" mode, what of a reused chunk is recomputed:
            "first_block" (its first KV block) or "fraction" (its leading chunk_recompute_fraction).
        chunk_recompute_fraction: share of a reused chunk's tokens recomputed in "fraction" mode.
            Range (0, 1]; 1 recomputes everything.
        chunk_miss: in "chunks" mode, what a request does with a chunk whose canonical KV is not
            cached. "wait": the chunk's compile (`head ‖ chunk`, standalone) is queued ahead and
            the request waits for it, then reuses it: the fewest tokens computed, but the request
            starts a step later and, under load, its compiles queue behind other prefills.
            "in_place" (the default): the request computes the chunk in its own prefill, exactly
            (no wait), and the compile is queued behind the request from the chunk's second miss
            on (a chunk retrieved once is usually one of the many cold ones, not worth compiling).
            On the H200 benchmark (docs/benchmarks.md) "in_place" had the lower TTFT sequentially
            and at half capacity, and the higher offline throughput.
        host_kv_blocks: size, in KV blocks, of a host-memory tier under the prefix cache (pinned
            on CUDA): a published block evicted from the GPU pool is copied there once, and a
            later lookup that misses on the GPU but finds the exact same block (namespace, prefix,
            tokens) copies it back instead of recomputing it. The host tier evicts by frequency
            and recency (GDSF: clock + uses). Costs num_layers x 2 x block_size x kv_heads x
            head_dim x dtype bytes per block (2 MiB for Llama-3.1-8B in bf16). 0, the default, is
            off. Needs prefix caching. Range >= 0.
        host_kv_admit_uses: a block the GPU evicts is copied to the host tier only if it was
            used at least this often while on the GPU (prefix-cache hits on it; a chunk compile's
            blocks start at one). 1, the default, keeps blocks computed once and never shared off
            the PCIe bus, which cost exact-prefix traffic throughput when every block was copied
            (docs/benchmarks.md); 0 admits every published block. Range >= 0.

        quantization: None (the default) runs the weights in `dtype`; "fp8" stores the decoder's
            linear layers (q/k/v/o, gate/up/down) in e4m3 with one fp32 scale per output channel
            and quantizes each token's activations on the fly (dynamic per-token scales): half
            the bytes a decode step streams, and FP8 tensor cores for prefill on Hopper/Ada. A
            bf16/fp32 checkpoint is quantized while it loads; a published FP8 checkpoint
            (compressed-tensors "FP8-dynamic", or `quant_method: fp8` with per-channel
            `weight_scale`) loads as it is and needs this set (it is set for you when the folder's
            config says so). The embedding, LM head and norms stay in `dtype`. On CPU (and GPUs
            without FP8) the layers compute through the reference path: dequantize, fp32 matmul.
        kv_cache_dtype: "auto" (the default) stores KV in `dtype`; "fp8" stores it in e4m3 with a
            per-layer scale for K and one for V (from the checkpoint's `k_scale`/`v_scale` where it
            has them, else 1.0): twice the tokens in the same memory. Works with the prefix cache,
            chunk reuse (keys re-rotated in fp32 and re-quantized) and the host tier.

        load_format: "auto" (the default) loads the folder's safetensors weights; "dummy" makes
            random weights (normal, std 0.02, seeded) directly on the device from config.json
            alone, in FP8 when quantization="fp8": for speed benchmarks of shapes whose
            checkpoint is not at hand (a 70B model on one GPU). Its answers are noise.

    Raises:
        ValueError: a value out of range.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    num_scheduler_steps: int | None = None
    dtype: str | torch.dtype | None = None
    device: str | None = None
    kv_reuse: str = "exact"
    chunk_recompute: str = "first_block"
    chunk_recompute_fraction: float = 0.15
    chunk_miss: str = "in_place"
    host_kv_blocks: int = 0
    host_kv_admit_uses: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"

    def __post_init__(self) -> None:
        # The limits the scheduler shares are checked by the same function it uses, so both
        # refuse the same values with the same words.
        check_engine_limits(self)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be None (measure) or >= 1, got {self.num_kv_blocks}")
        if self.dtype is not None and self.dtype_name not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; valid: None, {', '.join(DTYPE_NAMES)}")
        if self.kv_reuse not in KV_REUSE_MODES:
            raise ValueError(f"kv_reuse {self.kv_reuse!r} is not supported; valid: {', '.join(KV_REUSE_MODES)}")
        if self.chunk_miss not in CHUNK_MISS_CHOICES:
            raise ValueError(f"chunk_miss {self.chunk_miss!r} is not supported; valid: {', '.join(CHUNK_MISS_CHOICES)}")
        if self.kv_reuse == "chunks" and not self.enable_prefix_caching:
            raise ValueError('kv_reuse="chunks" keeps chunk KV in the prefix cache: enable_prefix_caching must be on')
        if self.host_kv_blocks < 0:
            raise ValueError(f"host_kv_blocks must be >= 0 (0 = no host tier), got {self.host_kv_blocks}")
        if self.host_kv_blocks and not self.enable_prefix_caching:
            raise ValueError("host_kv_blocks > 0 keeps prefix-cache blocks: enable_prefix_caching must be on")
        if self.host_kv_admit_uses < 0:
            raise ValueError(f"host_kv_admit_uses must be >= 0 (0 admits every block), got {self.host_kv_admit_uses}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; valid: None, {', '.join(QUANTIZATION_CHOICES)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            valid = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; valid: {valid}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not supported; valid: {', '.join(LOAD_FORMATS)}")
        # The recompute choice is checked where it lives (ChunkRecompute), with its own words.
        self.chunk_recompute_choice()

    def chunk_recompute_choice(self) -> ChunkRecompute:
        """chunk_recompute and its fraction as the planner's setting."""
        from generation.engine.chunk_reuse import ChunkRecompute

        return ChunkRecompute(self.chunk_recompute, self.chunk_recompute_fraction)

    def scheduler_steps_on(self, device_type: str) -> int:
        """num_scheduler_steps, with None resolved for a device type ("cuda", "cpu")."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return DEFAULT_CUDA_SCHEDULER_STEPS if device_type == "cuda" else 1

    @property
    def dtype_name(self) -> str | None:
        """The dtype as a name ("bfloat16"), whether it was given as a string or a torch dtype."""
        if self.dtype is None:
            return None
        return str(self.dtype).removeprefix("torch.")
