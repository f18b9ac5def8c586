"""Reading BERT weights out of a (possibly INT8-quantized) ONNX graph: the packaged models' converters.

The packaged cross-encoder (retrieval/reranker_convert.py) and the packaged BGE embedder
(ingest/embed/packaged_bge.py) ship as onnxruntime-quantized ONNX files; both are converted once
into Hugging Face folders (fp32 safetensors), which load on any device. This module walks the
graph: dequantized MatMul weights named by the Add that applies their bias, float initializers
that already carry module names, quantized embedding tables, head count and LayerNorm epsilon.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from rag.errors import ModelError

TOKENIZER_FILES = (
    "tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json",
)


class OnnxGraph:
    """Constants, producers and consumers of an ONNX graph, for pattern walking."""

    def __init__(self, onnx_path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        try:
            model = onnx.load(str(onnx_path))
        except Exception as e:  # protobuf errors have no common base class worth naming
            raise ModelError(f"could not read ONNX model {onnx_path}: {e}") from e
        self.nodes = list(model.graph.node)
        self.consts: dict[str, np.ndarray] = {
            t.name: numpy_helper.to_array(t) for t in model.graph.initializer
        }
        for node in self.nodes:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        self.consts[node.output[0]] = numpy_helper.to_array(attr.t)
        self.producer: dict[str, Any] = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for node in self.nodes:
            for name in node.input:
                self.consumers[name].append(node)

    def const(self, name: str | None) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    def ops(self) -> set[str]:
        return {n.op_type for n in self.nodes}


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                axis: int | None = None) -> np.ndarray:
    """(q - zero_point) * scale in float32; per-axis scales broadcast along `axis`."""
    scale = np.asarray(scale, dtype=np.float32)
    zp = np.zeros((), np.float32) if zero_point is None else np.asarray(zero_point, np.float32)
    if scale.ndim == 1 and scale.size > 1 and axis is not None:
        shape = [1] * q.ndim
        shape[axis] = scale.size
        scale, zp = scale.reshape(shape), (zp.reshape(shape) if zp.ndim == 1 else zp)
    return ((q.astype(np.float32) - zp) * scale).astype(np.float32)


def _attr(node: Any, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _matmul_weight_scale(graph: OnnxGraph, node: Any) -> tuple[np.ndarray | None, str]:
    """Weight scale of a MatMulInteger, and the name of its float (rescaled) output.

    onnxruntime's dynamic quantizer emits MatMulInteger -> Cast -> Mul(x, a_scale * w_scale);
    the weight's scale is the constant operand of that scale product.
    """
    out = node.output[0]
    for cast in graph.consumers[out]:
        if cast.op_type != "Cast":
            continue
        for mul in graph.consumers[cast.output[0]]:
            if mul.op_type != "Mul":
                continue
            other = next(i for i in mul.input if i != cast.output[0])
            scale = graph.const(other)
            if scale is None and other in graph.producer:
                scales = graph.producer[other]
                consts = [graph.const(i) for i in scales.input if graph.const(i) is not None]
                scale = consts[0] if scales.op_type == "Mul" and len(consts) == 1 else None
            return scale, mul.output[0]
    return None, out


def _bias_name(graph: OnnxGraph, value: str) -> str | None:
    """Follow a matmul's float output to the Add that applies a named `*.bias` constant."""
    for _ in range(4):  # the bias Add sits at most a Cast/Mul/Dequantize or two downstream
        users = graph.consumers.get(value, [])
        if len(users) != 1:
            return None
        user = users[0]
        if user.op_type == "Add":
            for name in user.input:
                if name != value and name in graph.consts and name.endswith(".bias"):
                    return name
            return None
        if user.op_type not in ("Cast", "Mul", "DequantizeLinear"):
            return None
        value = user.output[0]
    return None


def _linear_name(graph: OnnxGraph, node: Any, weight_name: str, float_out: str) -> str | None:
    """The PyTorch parameter name (`...weight`) of a MatMul-like node's weight."""
    bias = _bias_name(graph, float_out)
    if bias is not None:
        return bias.removesuffix(".bias") + ".weight"
    base = weight_name.removesuffix("_quantized")
    if base.endswith(".weight") and not base.startswith("onnx::"):
        return base
    # torch.onnx names nodes by module path: "/bert/encoder/layer.0/attention/self/query/MatMul"
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(node.name.strip("/").split("/")[:-1]) + ".weight"
    return None


def bert_weights(graph: OnnxGraph) -> dict[str, np.ndarray]:
    """Float32 PyTorch-layout tensors keyed by BERT parameter names."""
    weights: dict[str, np.ndarray] = {}
    # Float initializers already carry module names (biases, LayerNorms, unquantized tables).
    for name, value in graph.consts.items():
        if value.dtype == np.float32 and "." in name and not name.startswith(("onnx::", "/")):
            weights[name] = value

    for node in graph.nodes:
        op, inputs = node.op_type, list(node.input)
        w: np.ndarray | None = None  # (in, out) MatMul layout
        weight_name, float_out = "", node.output[0]
        if op == "MatMulInteger" and graph.const(inputs[1]) is not None:
            weight_name = inputs[1]
            scale, float_out = _matmul_weight_scale(graph, node)
            if scale is None:  # fall back on the quantizer's naming convention
                scale = graph.const(weight_name.removesuffix("_quantized") + "_scale")
            if scale is None:
                raise ModelError(f"cannot find the weight scale of {node.name} ({weight_name})")
            zp = graph.const(inputs[3]) if len(inputs) > 3 else None
            w = dequantize(graph.consts[weight_name], scale, zp, axis=1)
        elif op == "QLinearMatMul" and graph.const(inputs[3]) is not None:
            weight_name = inputs[3]
            w = dequantize(graph.consts[inputs[3]], graph.consts[inputs[4]],
                            graph.const(inputs[5]), axis=1)
            dq = [n for n in graph.consumers[node.output[0]] if n.op_type == "DequantizeLinear"]
            float_out = dq[0].output[0] if dq else float_out
        elif op in ("MatMul", "Gemm") and inputs[1] in graph.producer:
            dq = graph.producer[inputs[1]]
            if dq.op_type == "DequantizeLinear" and graph.const(dq.input[0]) is not None:
                weight_name = dq.input[0]
                axis = _attr(dq, "axis", 1)
                w = dequantize(graph.consts[weight_name], graph.consts[dq.input[1]],
                                graph.const(dq.input[2] if len(dq.input) > 2 else None), axis)
        elif op in ("MatMul", "Gemm") and graph.const(inputs[1]) is not None:
            weight_name = inputs[1]
            w = graph.consts[weight_name].astype(np.float32)
        if w is None:
            continue
        if op == "Gemm" and _attr(node, "transB", 0):
            w = w.T  # Gemm with transB already holds (out, in)
        name = _linear_name(graph, node, weight_name, float_out)
        if name is None:
            raise ModelError(f"cannot tell which layer ONNX node {node.name!r} belongs to")
        weights[name] = np.ascontiguousarray(w.T)  # nn.Linear stores (out, in)
        if op == "Gemm" and len(inputs) > 2 and graph.const(inputs[2]) is not None:
            weights[name.removesuffix(".weight") + ".bias"] = graph.consts[inputs[2]]

    # Embedding tables quantized as Gather(table_q) -> DequantizeLinear(scale, zero_point).
    for node in graph.nodes:
        if node.op_type != "DequantizeLinear" or node.input[0] not in graph.producer:
            continue
        gather = graph.producer[node.input[0]]
        table = graph.const(gather.input[0]) if gather.op_type == "Gather" else None
        if table is None:
            continue
        name = gather.input[0].removesuffix("_quantized")
        zp = graph.const(node.input[2]) if len(node.input) > 2 else None
        weights[name] = dequantize(table, graph.consts[node.input[1]], zp, axis=None)
    return weights


def num_attention_heads(graph: OnnxGraph, hidden: int) -> int:
    """Heads from the (batch, seq, heads, head_dim) reshape of the first query projection."""
    for node in graph.nodes:
        if node.op_type != "Reshape" or "attention" not in node.name:
            continue
        shape_name = node.input[1]
        values: list[int] = []
        const = graph.const(shape_name)
        if const is not None:
            values = [int(v) for v in const.ravel()]
        elif shape_name in graph.producer and graph.producer[shape_name].op_type == "Concat":
            for i in graph.producer[shape_name].input:
                c = graph.const(i)
                values.append(int(c.ravel()[0]) if c is not None and c.size == 1 else -1)
        for a, b in zip(values, values[1:], strict=False):
            if a > 1 and b > 1 and a * b == hidden:
                return a
    raise ModelError("cannot infer the number of attention heads from the ONNX graph")


def layer_norm_eps(graph: OnnxGraph) -> float:
    """Epsilon of the first decomposed LayerNorm (Add(ReduceMean(x^2), eps)), else BERT's."""
    for node in graph.nodes:
        if node.op_type == "LayerNormalization":
            return float(_attr(node, "epsilon", 1e-12))
        if node.op_type == "Add" and node.input[0] in graph.producer:
            if graph.producer[node.input[0]].op_type == "ReduceMean":
                eps = graph.const(node.input[1])
                if eps is not None and eps.size == 1:
                    return float(f"{float(eps.ravel()[0]):.7g}")  # 1e-12, not float32's 9.99e-13
    return 1e-12


def bert_config(graph: OnnxGraph, weights: dict[str, np.ndarray], prefix: str, **extra: Any) -> Any:
    """The BertConfig of a graph's weights, named under `prefix` ("bert." in a classifier, "" in an encoder)."""
    from transformers import BertConfig

    def shape(name: str) -> tuple[int, ...]:
        if prefix + name not in weights:
            raise ModelError(f"the ONNX graph has no tensor for {prefix}{name}; is it a BERT model?")
        return tuple(weights[prefix + name].shape)

    vocab, hidden = shape("embeddings.word_embeddings.weight")
    layer_re = re.compile(re.escape(prefix) + r"encoder\.layer\.(\d+)\.")
    layers = {int(m.group(1)) for k in weights if (m := layer_re.match(k))}
    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=max(layers) + 1 if layers else 0,
        num_attention_heads=num_attention_heads(graph, hidden),
        intermediate_size=shape("encoder.layer.0.intermediate.dense.weight")[0],
        max_position_embeddings=shape("embeddings.position_embeddings.weight")[0],
        type_vocab_size=shape("embeddings.token_type_embeddings.weight")[0],
        layer_norm_eps=layer_norm_eps(graph),
        # Erf is exact GELU; the tanh approximation would show up as Tanh inside each layer.
        hidden_act="gelu" if "Erf" in graph.ops() else "gelu_new",
        **extra,
    )


def checked_state(
    model_class: Any, config: Any, weights: dict[str, np.ndarray], source: Path, **init: Any
) -> dict[str, Any]:
    """The weights as torch tensors for model_class(config, **init), every name and shape checked.

    Raises:
        ModelError: a parameter is missing or has another shape.
    """
    import torch

    from rag.quiet import quiet_libraries

    # Names and shapes against the real architecture (no memory, no init cost on meta).
    with torch.device("meta"), quiet_libraries():
        expected = model_class(config, **init).state_dict()
    missing = [k for k in expected if k not in weights]
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k].shape]
    if missing or wrong:
        raise ModelError(
            f"{source} does not map onto {model_class.__name__}: missing {missing[:5]}, wrong shapes {wrong[:5]}"
        )
    # Copies: initializers are read-only views of the protobuf, which torch will not wrap.
    return {k: torch.from_numpy(np.array(weights[k], dtype=np.float32)) for k in expected}


def conversion_marker(onnx_path: Path, version: int) -> dict[str, Any]:
    """What a converted folder records of its source, to tell later whether it is still current."""
    return {"source": str(onnx_path.resolve()), "source_size": onnx_path.stat().st_size, "converter_version": version}


def is_converted(out_dir: Path, onnx_path: Path, marker_file: str, version: int) -> bool:
    """True when out_dir is a complete conversion of this ONNX file by this converter version."""
    try:
        marker = json.loads((out_dir / marker_file).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("converter_version") == version
        and marker.get("source_size") == onnx_path.stat().st_size
        and (out_dir / "config.json").is_file()
        and (out_dir / "model.safetensors").is_file()
    )


def copy_tokenizer(src: Path, dst: Path, max_length: int) -> None:
    """The tokenizer files beside an ONNX model, without the packaged 512-token padding."""
    if not (src / "tokenizer.json").is_file() and not (src / "vocab.txt").is_file():
        raise ModelError(f"no tokenizer.json or vocab.txt next to {src}; cannot convert")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    if (dst / "tokenizer.json").is_file():
        # The packaged file pads every input to 512 tokens; drop that so batches pad only to
        # their longest pair (the caller asks for padding and truncation explicitly).
        spec = json.loads((dst / "tokenizer.json").read_text())
        spec["padding"], spec["truncation"] = None, None
        (dst / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg["model_max_length"] = max_length
    cfg_path.write_text(json.dumps(cfg, indent=2))


def publish_converted(onnx_path: Path, out_dir: Path, state: dict[str, Any], config: Any, marker_file: str,
                      version: int, extra_files: dict[str, str] | None = None) -> Path:  # fmt: skip
    """Write a converted model folder (weights, config, tokenizer, marker, extra files) and publish it.

    Built under a temporary name and renamed into place, so a crash or a concurrent converter
    never leaves half a model; a concurrent converter's complete folder wins.

    Args:
        onnx_path: the ONNX source (its tokenizer files beside it).
        out_dir: the folder to create or replace.
        state: the fp32 state dict to save as model.safetensors.
        config: the transformers config to save.
        marker_file, version: the converter's marker (what `is_converted` checks later).
        extra_files: more files by relative path (one folder deep at most) and their text.
    """
    from safetensors.torch import save_file

    from rag.atomic import publish_dir
    from rag.private_files import private_mkdir
    from rag.quiet import quiet_libraries

    out_dir = Path(out_dir)
    private_mkdir(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with quiet_libraries():  # transformers logs every save at INFO
            config.save_pretrained(tmp)
        copy_tokenizer(onnx_path.parent, tmp, config.max_position_embeddings)
        for name, text in (extra_files or {}).items():
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_text(text)
        (tmp / marker_file).write_text(json.dumps(conversion_marker(onnx_path, version), indent=2))
        publish_dir(tmp, out_dir, lambda d: is_converted(d, onnx_path, marker_file, version))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
