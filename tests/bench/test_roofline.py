"""bench/roofline.py: the bytes a decode step reads, counted from real parameters, and the floors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from generation.config import ModelConfig
from generation.models.llama import LlamaForCausalLM
from tests.bench import loaded_bench

ROOFLINE = Path(__file__).resolve().parents[2] / "bench" / "roofline.py"


@pytest.fixture(scope="module")
def roofline():
    yield from loaded_bench("roofline")


def tiny_config(tied: bool = False, **kw) -> ModelConfig:
    fields = dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=tied, attention_bias=False,
    )  # fmt: skip
    fields.update(kw)
    return ModelConfig(**fields)


def real_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def layer_params(c: ModelConfig) -> int:
    """Parameters of one decoder layer (q/k/v/o, gate/up/down, two norms), by hand."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return attn + mlp + 2 * c.hidden_size


def test_untied_decode_skips_the_embedding_but_reads_one_row_per_sequence(roofline):
    c = tiny_config()
    model = real_model(c, torch.bfloat16)
    counted = roofline.decode_bytes(model, context_len=100, batch=3, kv_dtype_bytes=2)
    emb = c.vocab_size * c.hidden_size * 2
    layers = c.num_hidden_layers * layer_params(c) * 2
    head = c.vocab_size * c.hidden_size * 2
    final_norm = c.hidden_size * 2
    assert counted.all_weight_bytes == emb + layers + head + final_norm
    assert counted.all_weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert counted.streamed_weight_bytes == layers + head + final_norm
    assert counted.embedding_bytes == emb and not counted.embedding_tied
    assert counted.embedding_row_bytes == 3 * c.hidden_size * 2
    # context × layers × 2 × kv_heads × head_dim × bytes × batch
    assert counted.kv_bytes == 100 * 2 * 2 * 2 * 16 * 2 * 3
    assert counted.total == counted.streamed_weight_bytes + counted.embedding_row_bytes + counted.kv_bytes
    assert counted.streamed_weight_bytes < counted.all_weight_bytes


def test_a_tied_head_streams_the_embedding_once(roofline):
    c = tiny_config(tied=True)
    model = real_model(c)
    counted = roofline.decode_bytes(model, context_len=10, batch=1, kv_dtype_bytes=4)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups by identity
    assert counted.embedding_tied
    assert counted.all_weight_bytes == unique == counted.streamed_weight_bytes
    assert counted.embedding_row_bytes == 0  # the row is part of the matrix the head streams


def test_a_head_sharing_the_embedding_storage_counts_once(roofline):
    # Two Parameter objects over one storage (tied by data pointer, not by identity).
    c = tiny_config(tied=True)
    model = LlamaForCausalLM(c)
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.data, requires_grad=False)
    counted = roofline.decode_bytes(model, context_len=1, batch=1, kv_dtype_bytes=4)
    assert counted.embedding_tied
    assert counted.all_weight_bytes == counted.streamed_weight_bytes
    assert counted.all_weight_bytes == sum(p.numel() * 4 for p in model.parameters()) - counted.embedding_bytes


@pytest.mark.parametrize("tied", [False, True])
def test_the_config_count_equals_the_module_count(roofline, tied):
    c = tiny_config(tied=tied)
    from_config = roofline.decode_bytes(c, 77, 2, 2, dtype=torch.bfloat16)
    from_module = roofline.decode_bytes(real_model(c, torch.bfloat16), 77, 2, 2)
    assert from_config == from_module


def test_fp8_weights_count_one_byte_plus_fp32_scales(roofline):
    c = tiny_config()
    counted = roofline.decode_bytes(c, 50, 1, 1, dtype=torch.bfloat16, quantization="fp8")
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    # (out, in) of the fused q/k/v, o, fused gate/up and down.
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    fp8_layer = sum(o * n * 1 + o * 4 for o, n in shapes) + 2 * h * 2  # e4m3 weight, fp32 scales, bf16 norms
    head = c.vocab_size * h * 2
    assert counted.streamed_weight_bytes == c.num_hidden_layers * fp8_layer + head + h * 2
    assert counted.all_weight_bytes == counted.streamed_weight_bytes + c.vocab_size * h * 2
    assert counted.kv_bytes == 50 * 2 * 2 * 2 * 16 * 1
    bf16 = roofline.decode_bytes(c, 50, 1, 2, dtype=torch.bfloat16)
    assert counted.total < bf16.total


def test_fp8_counted_from_the_engines_own_model(roofline):
    # The model the engine builds for quantization="fp8" (on CPU, dummy weights as load_format="dummy" fills them).
    for tied in (False, True):
        c = tiny_config(tied=tied)
        model = LlamaForCausalLM.create_empty(c, torch.device("cpu"), torch.bfloat16, quantization="fp8")
        model.fill_dummy_weights()
        assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
        from_module = roofline.decode_bytes(model, 50, 1, 1)
        from_config = roofline.decode_bytes(c, 50, 1, 1, dtype=torch.bfloat16, quantization="fp8")
        assert from_module == from_config
        assert from_module.embedding_tied == tied


def test_floors_and_their_lines(roofline):
    c = tiny_config()
    counted = roofline.decode_bytes(c, 640, 1, 2)
    old, honest = roofline.DecodeFloor.old_and_honest(counted, read_bw=4.0e12, copy_bw=4.2e12)
    assert old.bytes == counted.all_weight_bytes and old.bandwidth == 4.2e12
    assert honest.bytes == counted.total and honest.bandwidth == 4.0e12
    assert honest.ms == pytest.approx(counted.total / 4.0e12 * 1e3)
    floor = roofline.DecodeFloor(15_040_000_000, 4.24e12)
    assert floor.describe() == "15.04 GB streamed / 4.24 TB/s read = 3.55 ms"
    line = roofline.DecodeFloor.comparison_line(roofline.DecodeFloor(16_060_000_000, 4.28e12, "all weights", "copy"),
                                                floor)  # fmt: skip
    assert line.startswith("old floor: all weights / copy bandwidth = 3.75 ms")
    assert line.endswith("honest floor: 15.04 GB streamed / 4.24 TB/s read = 3.55 ms")
    assert roofline.percent_of_floor(3.55, 4.0) == pytest.approx(88.75)


def test_llama8b_shape_streams_about_15_gb(roofline):
    # The numbers docs/benchmarks.md quotes: 16.06 GB of bf16 weights, 1.05 GB of them the embedding.
    c = tiny_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    counted = roofline.decode_bytes(c, 640, 1, 2)
    assert counted.all_weight_bytes / 1e9 == pytest.approx(16.06, abs=0.01)
    assert counted.embedding_bytes / 1e9 == pytest.approx(1.05, abs=0.01)
    assert counted.streamed_weight_bytes / 1e9 == pytest.approx(15.01, abs=0.01)
    assert counted.kv_bytes == 640 * 32 * 2 * 8 * 128 * 2  # 84 MB at context 640


def test_prefill_flops(roofline):
    c = tiny_config()
    layers, head = roofline.matmul_parameters(c)
    assert layers == c.num_hidden_layers * (layer_params(c) - 2 * c.hidden_size)
    assert head == c.vocab_size * c.hidden_size
    flops = roofline.prefill_flops(c, 100)
    assert flops == 2 * layers * 100 + 2 * head + 2 * 2 * 4 * 16 * 100**2
    assert roofline.prefill_flops(real_model(c), 100) == flops


def test_bandwidths_on_cpu(roofline):
    assert roofline.read_bandwidth("cpu", gib=1 / 256, reps=2) > 0
    assert roofline.copy_bandwidth("cpu", gib=1 / 256, reps=2) > 0
