"""The packaged reranker: ONNX -> Hugging Face conversion, parity with onnxruntime, reranking."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import retrieval.rerank as rerank_module
from rag.errors import ConfigError, ModelError
from rag.types import Hit
from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir
from retrieval.reranker_convert import (
    DEFAULT_RERANKER_NAME,
    MARKER_FILE,
    _is_converted,
    convert_onnx_reranker,
    packaged_reranker_onnx,
)

# The models themselves are under test here: every forward pass is computed (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("without_forward_memo")

# Belt and braces: the code loads with local_files_only, and a test must never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SLURM = "How do I submit a job array with Slurm?"
PAIRS = [
    (SLURM, "Use sbatch --array=1-10 job.sh to submit a Slurm job array; each task gets "
            "SLURM_ARRAY_TASK_ID."),
    (SLURM, "The cafeteria serves lunch from noon to two."),
    (SLURM, "Slurm is a workload manager for Linux clusters."),
    ("What is the capital of France?", "Paris is the capital and most populous city of France."),
    ("What is the capital of France?", "Berlin is the capital of Germany."),
    ("What is the capital of France?", "France is a country in Western Europe."),
    ("how many GPUs does each node have", "Each compute node has four NVIDIA A100 GPUs with "
                                          "80 GB of memory and 512 GB of RAM."),
    ("how many GPUs does each node have", "The storage quota for home directories is 50 GB."),
    ("python virtual environment", "Create one with python -m venv .venv and activate it."),
    ("python virtual environment", "Photosynthesis converts light energy into chemical energy."),
]
QUERY_GROUPS = [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]  # PAIRS by query
# Measured: max |torch - onnxruntime| = 0.378 logits (mean 0.215) on a ~19-logit range,
# Pearson 0.99987.
# The gap is onnxruntime quantizing activations to uint8 at every MatMul (the converted
# model keeps them in fp32), so the bound is loose in absolute terms but rankings agree.
MAX_ABS_DIFF = 0.6
MIN_CORRELATION = 0.999


@pytest.fixture(scope="session")
def cache_dir(model_cache: Path) -> Path:
    return model_cache


@pytest.fixture(scope="session")
def model_dir(cache_dir: Path) -> Path:
    return resolve_reranker_dir(None, cache_dir)


@pytest.fixture(scope="session")
def reranker(model_dir: Path) -> CrossEncoderReranker:
    # fp32 (what "auto" gives on a CPU without native bf16): these tests check the conversion
    # itself; bf16 has its own tests below.
    return CrossEncoderReranker(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def reranker_bf16(model_dir: Path) -> CrossEncoderReranker:
    return CrossEncoderReranker(model_dir, device="cpu", dtype="bfloat16")


def _hit(i: int, text: str, score: float = 0.5) -> Hit:
    return Hit(chunk_id=i, document_key=f"doc{i}.md", source=f"/lab/doc{i}.md", chunk_index=0,
               text=text, score=score, acl=frozenset({"public"}))


def test_converted_folder_layout(model_dir: Path) -> None:
    assert model_dir == model_dir.parent / DEFAULT_RERANKER_NAME
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["intermediate_size"]) == (12, 384, 12, 1536)
    assert (config["vocab_size"], config["max_position_embeddings"],
            config["type_vocab_size"]) == (30522, 512, 2)
    assert len(config["id2label"]) == 1  # one relevance logit
    assert (model_dir / MARKER_FILE).is_file()
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]  # no leftovers


def test_scores_match_onnxruntime(reranker: CrossEncoderReranker) -> None:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    onnx_path = packaged_reranker_onnx()
    original = Tokenizer.from_file(str(onnx_path.parent / "tokenizer.json"))
    original.no_padding()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

    reference = []
    for query, passage in PAIRS:
        enc = original.encode(query, passage)
        # The converted folder's tokenizer must produce exactly the packaged tokenizer's ids.
        assert reranker.tokenizer(query, passage)["input_ids"] == enc.ids
        feeds = {
            "input_ids": np.array([enc.ids], dtype=np.int64),
            "attention_mask": np.array([enc.attention_mask], dtype=np.int64),
            "token_type_ids": np.array([enc.type_ids], dtype=np.int64),
        }
        reference.append(float(session.run(["logits"], feeds)[0][0, 0]))
    reference_arr = np.array(reference)
    ours = np.array([reranker.score(q, [p])[0] for q, p in PAIRS])

    diff = np.abs(ours - reference_arr)
    corr = float(np.corrcoef(ours, reference_arr)[0, 1])
    print(f"\nmax |diff| {diff.max():.4f}, mean |diff| {diff.mean():.4f}, pearson {corr:.6f}")
    assert diff.max() <= MAX_ABS_DIFF
    assert corr >= MIN_CORRELATION
    for group in QUERY_GROUPS:  # each query's passages rank the same way
        assert list(np.argsort(ours[group])) == list(np.argsort(reference_arr[group]))
    # Batching (padding) must not change a score.
    batched = reranker.score(SLURM, [p for _, p in PAIRS[:3]])
    np.testing.assert_allclose(batched, ours[:3], atol=1e-4)


def test_relevant_passage_scores_highest(reranker: CrossEncoderReranker) -> None:
    passages = [p for _, p in PAIRS[:3]] + ["Lunch is served in the cafeteria."]
    scores = reranker.score(SLURM, passages)
    assert int(np.argmax(scores)) == 0
    assert scores[0] - max(scores[1:]) > 5.0  # logits: a wide, not marginal, margin


def test_rerank_reorders_hits(reranker: CrossEncoderReranker) -> None:
    hits = [
        _hit(1, "The cafeteria serves lunch from noon to two.", score=0.9),
        _hit(2, "Slurm is a workload manager for Linux clusters.", score=0.8),
        _hit(3, PAIRS[0][1], score=0.1),
    ]
    ranked = reranker.rerank(SLURM, hits)
    assert [h.chunk_id for h in ranked] == [3, 2, 1]
    assert ranked[0].score > ranked[1].score > ranked[2].score
    assert ranked[0].score == pytest.approx(reranker.score(SLURM, [PAIRS[0][1]])[0], abs=1e-4)
    assert hits[2].score == 0.1  # inputs are untouched: new Hit objects come back
    assert ranked[0].acl == hits[2].acl and ranked[0].source == hits[2].source
    assert [h.chunk_id for h in reranker.rerank(SLURM, hits, top_n=1)] == [3]
    assert reranker.rerank(SLURM, hits, top_n=0) == []
    assert reranker.rerank(SLURM, []) == []
    with pytest.raises(ConfigError):
        reranker.rerank(SLURM, hits, top_n=-1)


def test_rerank_is_stable_on_ties(reranker: CrossEncoderReranker) -> None:
    same = "Slurm is a workload manager for Linux clusters."
    hits = [_hit(i, same) for i in (7, 3, 9)] + [_hit(1, PAIRS[0][1])]
    assert [h.chunk_id for h in reranker.rerank(SLURM, hits)] == [1, 7, 3, 9]


def test_conversion_is_cached(model_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = model_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.stat().st_ino, (model_dir / MARKER_FILE).read_text())
    conversions: list[Path] = []

    def counting_convert(onnx_path: Path, out_dir: Path) -> Path:
        conversions.append(out_dir)
        return convert_onnx_reranker(onnx_path, out_dir)

    # resolve_reranker_dir converts through this name: a second resolve must reuse the folder.
    monkeypatch.setattr("retrieval.rerank.convert_onnx_reranker", counting_convert)
    assert resolve_reranker_dir(None, cache_dir) == model_dir
    assert conversions == []
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino, (model_dir / MARKER_FILE).read_text()) == before


def test_stale_marker_is_not_trusted(model_dir: Path, tmp_path: Path) -> None:
    onnx_path = packaged_reranker_onnx()
    assert _is_converted(model_dir, onnx_path)
    fake = tmp_path / "stale"
    fake.mkdir()
    for name in ("config.json", "model.safetensors"):
        (fake / name).write_text("{}")
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    (fake / MARKER_FILE).write_text(json.dumps({**marker, "converter_version": -1}))
    assert not _is_converted(fake, onnx_path)
    (fake / MARKER_FILE).unlink()
    assert not _is_converted(fake, onnx_path)  # no marker: an interrupted or foreign folder


def test_explicit_folder_is_returned_as_is(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_reranker_dir(model_dir, tmp_path) == model_dir
    assert not (tmp_path / "reranker").exists()


def test_bad_paths_are_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_reranker_dir(tmp_path / "nope", tmp_path)
    with pytest.raises(ModelError, match="no config.json"):
        resolve_reranker_dir(tmp_path, tmp_path)
    with pytest.raises(ModelError, match="no config.json"):
        CrossEncoderReranker(tmp_path / "nope", device="cpu")
    with pytest.raises(ModelError, match="does not exist"):
        convert_onnx_reranker(tmp_path / "missing.onnx", tmp_path / "out")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not an onnx file")
    with pytest.raises(ModelError):
        convert_onnx_reranker(garbage, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_scores_do_not_depend_on_the_batch_size(model_dir: Path, reranker: CrossEncoderReranker) -> None:
    # Pairs are sorted by length before batching, so each batch size pads differently: the
    # scores must not move.
    pairs = PAIRS * 3
    expected = reranker.score_pairs(pairs)
    for size in (1, 5, 8):
        other = CrossEncoderReranker(model_dir, device="cpu", dtype="float32", batch_size=size)
        np.testing.assert_allclose(other.score_pairs(pairs), expected, atol=1e-4)


def test_bf16_scores_stay_close_to_fp32_and_rank_the_same(reranker: CrossEncoderReranker,
                                                          reranker_bf16: CrossEncoderReranker) -> None:
    assert reranker_bf16.dtype == "bfloat16"
    import torch

    assert next(reranker_bf16.model.parameters()).dtype == torch.float32  # autocast: weights stay fp32
    fp32 = np.array(reranker.score_pairs(PAIRS))
    bf16 = np.array(reranker_bf16.score_pairs(PAIRS))
    print(f"\nbf16 vs fp32: max |diff| {np.abs(bf16 - fp32).max():.4f} on a {np.ptp(fp32):.1f}-logit range")
    assert np.abs(bf16 - fp32).max() < 0.25
    for group in QUERY_GROUPS:
        assert list(np.argsort(bf16[group])) == list(np.argsort(fp32[group]))
    assert [h.chunk_id for h in reranker_bf16.rerank(SLURM, [_hit(1, PAIRS[1][1]), _hit(2, PAIRS[0][1])])] == [2, 1]


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_a_cpu_is_bf16_only_where_it_is_native(model_dir: Path, monkeypatch, native: bool) -> None:
    # Emulated bf16 is slower than fp32 (bench/rerank_speed.py), so auto takes it only where the
    # cores compute it; one pair per pass on a CPU either way.
    monkeypatch.setattr(rerank_module, "cpu_has_native_bf16", lambda: native)
    reranker = CrossEncoderReranker(model_dir, device="cpu")
    assert reranker.dtype == ("bfloat16" if native else "float32")
    assert reranker.batch_size == 1


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True),  # Cooper Lake, Zen 4
        ("fpu sse2 avx2 avx512f amx_tile amx_bf16", True),  # Sapphire Rapids
        ("fpu sse2 avx2 avx512f avx512_vnni", False),  # AVX-512 without bf16: emulated
        ("fpu sse2 avx2 avx512_bf16x", False),  # a flag is a whole word, not a prefix
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path: Path, flags: str, native: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert rerank_module.cpu_has_native_bf16(str(cpuinfo)) is native


def test_without_cpu_flags_bf16_is_not_native(tmp_path: Path) -> None:
    # macOS has no /proc/cpuinfo, an ARM one names "Features" not "flags": fp32, never emulated bf16.
    assert rerank_module.cpu_has_native_bf16(str(tmp_path / "missing")) is False
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert rerank_module.cpu_has_native_bf16(str(arm)) is False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_cpu_a_pairs_score_depends_on_nothing_scored_beside_it(model_dir: Path, dtype: str) -> None:
    # The service scores concurrent users' pairs in one call: on a CPU (one pair per pass) a
    # pair's score must be bit for bit the same alone, beside any others and in any order, so
    # nothing about another user's texts (not even their lengths) reaches it.
    reranker = CrossEncoderReranker(model_dir, device="cpu", dtype=dtype)
    alone = [reranker.score_pairs([pair])[0] for pair in PAIRS]
    others = [("a long question " * 20, "an unrelated passage about the weather " * 40), *PAIRS[::-1]]
    together = reranker.score_pairs(others)[1:][::-1]
    assert together == alone


def test_bf16_logits_do_not_tie_on_the_bf16_grid(reranker_bf16: CrossEncoderReranker) -> None:
    # The head runs in fp32: bf16 logits would sit on steps of 1/32 to 1/16 here, and unrelated
    # passages would tie (ties keep input order, so reversed input would rank differently).
    scores = np.array(reranker_bf16.score(SLURM, [p for _, p in PAIRS]))
    assert any(abs(s * 64 - round(s * 64)) > 1e-3 for s in scores)
    assert len(set(scores.tolist())) == len(set(p for _, p in PAIRS))


def test_bad_dtypes_and_batch_sizes_are_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        CrossEncoderReranker(model_dir, device="cpu", dtype="int4")
    with pytest.raises(ValueError, match="batch_size"):
        CrossEncoderReranker(model_dir, device="cpu", batch_size=0)
    with pytest.raises(ConfigError, match="float16 needs a CUDA device"):
        CrossEncoderReranker(model_dir, device="cpu", dtype="float16")
