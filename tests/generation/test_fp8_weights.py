"""FP8 weights: per-channel quantization, the CPU reference path, online quantization, FP8 and dummy checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from generation.layers.fp8 import (
    FP8_DTYPE,
    MIN_SCALE,
    Fp8Linear,
    Fp8Rows,
    dequantize_rows,
    fp8_linear_reference,
    quantize_rows,
    quantize_weight,
)
from generation.layers.linear import Linear
from generation.loader import checkpoint_quantization, load_model
from rag.errors import ModelError

# e4m3 keeps 3 mantissa bits: a value in the normal range is within 2^-4 of itself after rounding.
E4M3_REL = 2.0**-4
PROMPTS = [[5, 17, 42, 9, 77, 3, 64, 12], [100, 101, 7, 7, 7, 55]]


def test_quantize_rows_maps_each_rows_largest_magnitude_to_448_and_rounds_within_e4m3():
    torch.manual_seed(0)
    x = torch.randn(8, 96) * torch.logspace(-3, 2, 8).unsqueeze(1)  # rows over five decades
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (8,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((8,), 448.0))
    err = (dequantize_rows(q, scale) - x).abs()
    # Normal e4m3 values (|q| >= 2^-6) are within half a step; below that the step is absolute.
    bound = torch.maximum(x.abs() * E4M3_REL, scale.unsqueeze(1) * 2.0**-10)
    assert bool((err <= bound + 1e-12).all())
    assert torch.isfinite(q.float()).all()


def test_quantize_rows_of_zeros_gives_zeros_not_nan():
    q, scale = quantize_rows(torch.zeros(3, 32))
    assert torch.equal(q.float(), torch.zeros(3, 32)) and torch.equal(scale, torch.full((3,), MIN_SCALE))


def test_quantize_weight_in_slices_equals_quantizing_every_row_at_once():
    torch.manual_seed(1)
    w = torch.randn(300, 64, dtype=torch.bfloat16)
    q, s = quantize_weight(w)
    q_ref, s_ref = quantize_rows(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_reference_linear_is_the_product_of_the_dequantized_operands_and_close_to_fp32():
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 64), torch.randn(48, 64) * 0.05, torch.randn(48)
    qw, sw = quantize_rows(w)
    y = fp8_linear_reference(x, qw, sw, b)
    qx, sx = quantize_rows(x)
    manual = (qx.float() * sx[:, None]) @ (qw.float() * sw[:, None]).t() + b
    assert torch.allclose(y, manual, rtol=1e-6, atol=1e-6)
    exact = x @ w.t() + b
    rel = (y - exact).norm() / exact.norm()
    assert rel < 0.05, f"FP8 product {rel:.3f} away from fp32"
    assert rel > 0, "the product must carry the quantization error (it is not the fp32 product)"


def test_fp8_linear_keeps_leading_dims_dtype_and_bias():
    layer = Fp8Linear(32, 16, bias=True, dtype=torch.float32)
    torch.manual_seed(3)
    q, s = quantize_rows(torch.randn(16, 32))
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        layer.bias.copy_(torch.arange(16.0))
    x = torch.randn(2, 3, 32)
    y = layer(x)
    assert y.shape == (2, 3, 16) and y.dtype == torch.float32
    assert torch.allclose(y, fp8_linear_reference(x.reshape(6, 32), q, s, layer.bias).view(2, 3, 16))
    assert torch.allclose(layer.dequantized_weight(), dequantize_rows(q, s))


def test_fp8_linear_takes_rows_its_producer_quantized_and_the_cpu_never_offers_them():
    """Fp8Rows (e4m3 rows, scales, the model dtype) give what the layer gives for the rows they quantize;
    off the GPU no producer is asked to quantize (the fused kernels are Triton)."""
    layer = Fp8Linear(32, 16, bias=True, dtype=torch.bfloat16)
    torch.manual_seed(4)
    q, s = quantize_rows(torch.randn(16, 32))
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(s)
        layer.bias.normal_()
    x = torch.randn(40, 32).to(torch.bfloat16)
    qx, sx = quantize_rows(x)
    y = layer(Fp8Rows(qx, sx, torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (40, 16)
    assert torch.equal(y, layer(x))
    assert not layer.takes_quantized_input(x)


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _decoder_linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj")}  # fmt: skip


def test_online_quantization_swaps_the_decoder_linears_and_quantizes_each_checkpoint_row(tiny_model_factory):
    path, hf = tiny_model_factory("default")
    model, _ = load_model(path, torch.device("cpu"), torch.float32, quantization="fp8")
    linears = _decoder_linears(model)
    assert linears and all(isinstance(m, Fp8Linear) for m in linears.values())
    assert isinstance(model.lm_head, Linear) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # q_proj's rows are the first rows of the fused qkv: the same bytes as quantizing them alone.
    q_ref, s_ref = quantize_rows(hf.model.layers[1].self_attn.q_proj.weight.detach())
    fused = model.model.layers[1].self_attn.qkv_proj
    n = q_ref.shape[0]
    assert torch.equal(fused.weight[:n].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(fused.weight_scale[:n], s_ref)
    d_ref, ds_ref = quantize_rows(hf.model.layers[0].mlp.down_proj.weight.detach())
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight_scale, ds_ref)


def test_fp8_model_logits_track_the_float_model(tiny_model_factory):
    path, _ = tiny_model_factory("default")
    ref, _ = load_model(path, torch.device("cpu"), torch.float32)
    fp8, _ = load_model(path, torch.device("cpu"), torch.float32, quantization="fp8")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        a = ref.compute_logits(ref(ids))
        b = fp8.compute_logits(fp8(ids))
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.98, f"FP8 logits drifted: cosine {cos:.4f}"
    assert not torch.equal(a, b)


def _write_fp8_checkpoint(src: Path, dst: Path, per_tensor: bool = False, kv_scales: bool = False) -> None:
    """A compressed-tensors FP8-dynamic folder from a float folder, written the way llm-compressor does.

    Each q/k/v/o/gate/up/down weight becomes e4m3 with a `weight_scale` of [N, 1] (per channel) or
    [1] (per tensor), plus a static `input_scale` the engine must ignore; the LM head stays float.
    """
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    out = {}
    for name, t in tensors.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            w = t.float()
            if per_tensor:
                scale = (w.abs().amax() / 448.0).reshape(1)
                q = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
            else:
                scale = (w.abs().amax(dim=1, keepdim=True) / 448.0)
                q = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
            out[name] = q
            out[name.removesuffix(".weight") + ".weight_scale"] = scale.to(torch.bfloat16 if not per_tensor
                                                                            else torch.float32)  # fmt: skip
            out[name.removesuffix(".weight") + ".input_scale"] = torch.tensor([0.5])
        else:
            out[name] = t
    if kv_scales:
        layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        for i in range(layers):
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25 + i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.125 + i)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    strategy = "tensor" if per_tensor else "channel"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head"],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))


def test_compressed_tensors_fp8_checkpoint_loads_in_fp8_and_answers_like_online_quantization(
    tiny_model_factory, tmp_path
):
    from generation import LLM, SamplingParams

    src, _ = tiny_model_factory("default", tokenizer=True)
    ckpt = tmp_path / "fp8-dynamic"
    _write_fp8_checkpoint(src, ckpt)
    assert checkpoint_quantization(ckpt) == "compressed-tensors fp8"
    stored = load_file(str(ckpt / "model.safetensors"))
    loaded = LLM(ckpt, device="cpu", num_kv_blocks=64)  # no quantization argument: the folder says FP8
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    gate = stored["model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(layer.mlp.gate_up_proj.weight[: gate.shape[0]].view(torch.uint8), gate.view(torch.uint8))
    gate_scale = stored["model.layers.0.mlp.gate_proj.weight_scale"].float().view(-1)
    assert torch.equal(layer.mlp.gate_up_proj.weight_scale[: gate.shape[0]], gate_scale)
    # The same weights quantized online from the float folder: the same greedy answers.
    online = LLM(src, device="cpu", quantization="fp8", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = [r.token_ids for r in loaded.generate(PROMPTS, params)]
    b = [r.token_ids for r in online.generate(PROMPTS, params)]
    # bf16-stored scales round the online fp32 scales, so compare the dequantized weights first.
    deq_ckpt = layer.mlp.gate_up_proj.dequantized_weight()
    deq_online = online.model.model.layers[0].mlp.gate_up_proj.dequantized_weight()
    assert torch.allclose(deq_ckpt, deq_online, rtol=2e-2, atol=1e-6)
    agree = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert agree >= 0.8 * sum(len(r) for r in a), (a, b)


def test_per_tensor_fp8_checkpoint_broadcasts_its_scale_and_reads_kv_scales(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("default")
    ckpt = tmp_path / "fp8-tensor"
    _write_fp8_checkpoint(src, ckpt, per_tensor=True, kv_scales=True)
    model, config = load_model(ckpt, torch.device("cpu"), torch.float32)
    stored = load_file(str(ckpt / "model.safetensors"))
    o = model.model.layers[1].self_attn.o_proj
    scale = stored["model.layers.1.self_attn.o_proj.weight_scale"]
    assert torch.equal(o.weight_scale, scale.expand(o.out_features))
    w = stored["model.layers.1.self_attn.o_proj.weight"]
    assert torch.allclose(o.dequantized_weight(), w.float() * scale)
    assert model.kv_cache_scales is not None and model.kv_cache_scales.shape == (config.num_hidden_layers, 2)
    assert model.kv_cache_scales[1].tolist() == [1.25, 1.125]


def test_kv_scales_for_only_some_layers_are_refused(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("default")
    ckpt = tmp_path / "fp8-partial"
    _write_fp8_checkpoint(src, ckpt, kv_scales=True)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelError, match="KV cache scales"):
        load_model(ckpt, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("quant", "words"),
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "block-wise"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "num_bits": 4, "type": "int", "strategy": "group"}}}}, "not supported"),
    ],
)
def test_quantization_schemes_the_engine_does_not_run_are_refused_with_their_name(
    tiny_model_factory, tmp_path, quant, words
):
    src, _ = tiny_model_factory("default")
    dst = tmp_path / "other"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=words):
        load_model(dst, torch.device("cpu"), torch.float32)


def test_quant_method_fp8_is_recognised(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("default")
    dst = tmp_path / "autofp8"
    _write_fp8_checkpoint(src, dst, per_tensor=True)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (dst / "config.json").write_text(json.dumps(config))
    assert checkpoint_quantization(dst) == "fp8"
    model, _ = load_model(dst, torch.device("cpu"), torch.float32)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)


def test_dummy_weights_need_only_config_json_and_are_made_in_fp8(tiny_model_factory, tmp_path):
    from generation import LLM, SamplingParams

    src, _ = tiny_model_factory("default")
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    with pytest.raises(ModelError, match="safetensors"):
        load_model(folder, torch.device("cpu"), torch.float32)
    a, _ = load_model(folder, torch.device("cpu"), torch.float32, quantization="fp8", load_format="dummy")
    b, _ = load_model(folder, torch.device("cpu"), torch.float32, quantization="fp8", load_format="dummy")
    qkv = a.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and float(qkv.weight.float().abs().max()) == 448.0
    assert torch.equal(qkv.weight.view(torch.uint8), b.model.layers[0].self_attn.qkv_proj.weight.view(torch.uint8))
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))
    llm = LLM(folder, device="cpu", load_format="dummy", quantization="fp8", num_kv_blocks=32)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
