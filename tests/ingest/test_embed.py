"""The embedder on the packaged all-MiniLM-L6-v2: shapes, order, truncation, relevance, errors,
and parity with a plain fp32 run (no sorting, fixed batches), as sentence-transformers computes it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ingest.embed.batches import TextEncoder, pad_rows, plan_batches
from ingest.embed.embedder import DEFAULT_EMBEDDER_NAME, Embedder, EmbedderConfig, default_embedder_path
from ingest.embed.prefetch import prefetch
from ingest.embed.runner import RunnerSpec
from ingest.embed.workers import EmbedWorkers
from rag.errors import ModelError

# The models themselves are under test here: every forward pass is computed (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("without_forward_memo")

# Belt and braces: the code loads with local_files_only, and a test must never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIXED = [
    "GPU",
    "How do I request a GPU node on the cluster?",
    "The lab's shared storage lives under /data/lab and is backed up nightly; scratch space "
    "under /scratch is purged after thirty days, so copy results you want to keep.",
    "Slurm job arrays run many copies of one script, each with SLURM_ARRAY_TASK_ID set. " * 6,
    "Photosynthesis.",
    "Permissions come from POSIX owner, group and mode bits, or from a sidecar ACL file.",
    "a b c",
]


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    # A small batch size so a handful of texts spans several length-sorted batches.
    return Embedder(EmbedderConfig(device="cpu", batch_size=3))


def test_shape_dtype_and_unit_rows(embedder: Embedder) -> None:
    vectors = embedder.embed(MIXED)
    assert vectors.shape == (len(MIXED), 384) == (len(MIXED), embedder.dim)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_batched_results_come_back_in_input_order(embedder: Embedder) -> None:
    batched = embedder.embed(MIXED)
    alone = np.stack([embedder.embed([t])[0] for t in MIXED])
    cosines = np.sum(batched * alone, axis=1)
    assert cosines.min() >= 0.9999, cosines
    # Distinct texts really are distinct, so a permuted output could not pass the check above.
    assert (alone @ alone.T - np.eye(len(MIXED))).max() < 0.99


def test_progress_reports_each_batch(embedder: Embedder) -> None:
    done: list[int] = []
    embedder.embed(MIXED, progress=done.append)
    # The token budget (batch_size × max_length) packs the short texts together: fewer calls
    # than texts, every text counted once.
    assert sum(done) == len(MIXED) and 1 < len(done) < len(MIXED) and min(done) >= 1


def test_empty_input(embedder: Embedder) -> None:
    vectors = embedder.embed([])
    assert vectors.shape == (0, embedder.dim) and vectors.dtype == np.float32


def test_long_text_is_truncated_not_fatal(embedder: Embedder) -> None:
    head = "Cluster accounts are created by the research computing team on request. " * 40
    assert len(embedder.tokenizer(head)["input_ids"]) > embedder.max_length
    long_text = head + "Completely different tail about marine biology and coral reefs. " * 400
    vectors = embedder.embed([long_text, head])
    assert np.isfinite(vectors).all()
    # Both are cut to the same first max_length tokens, so the tail cannot matter.
    assert float(vectors[0] @ vectors[1]) >= 0.9999


def test_embed_query_matches_embed(embedder: Embedder) -> None:
    query = "how do I get a GPU"
    vector = embedder.embed_query(query)
    assert vector.shape == (embedder.dim,)
    assert float(vector @ embedder.embed([query])[0]) >= 0.9999


def test_relevant_passage_ranks_far_above_unrelated(embedder: Embedder) -> None:
    query = embedder.embed_query("How do I submit an array of jobs with Slurm?")
    passages = [
        "The cafeteria serves lunch from noon until two o'clock.",
        "Use sbatch --array=1-100 job.sh to submit a Slurm job array of 100 tasks.",
        "Photosynthesis converts light into chemical energy in plants.",
        "The annual lab retreat takes place in the mountains in September.",
    ]
    scores = embedder.embed(passages) @ query
    assert int(np.argmax(scores)) == 1
    assert scores[1] - np.delete(scores, 1).max() > 0.3, scores


def test_identity(embedder: Embedder) -> None:
    assert embedder.name == DEFAULT_EMBEDDER_NAME
    assert len(embedder.fingerprint) == 16
    assert embedder.device == "cpu"
    assert embedder.tokenizer.is_fast
    assert embedder.pooling == "mean"  # what the packaged 1_Pooling/config.json says
    assert default_embedder_path().joinpath("config.json").is_file()


def test_missing_folder_is_a_model_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelError, match="no-such-model.*does not exist"):
        Embedder(EmbedderConfig(model=missing, device="cpu"))


def test_folder_without_config_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="no config.json"):
        Embedder(EmbedderConfig(model=tmp_path, device="cpu"))


def test_cls_pooling_is_honoured(tmp_path: Path) -> None:
    # A copy of the packaged model that declares CLS pooling must pool differently.
    src = default_embedder_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.txt"):
        (tmp_path / name).symlink_to(src / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        '{"word_embedding_dimension": 384, "pooling_mode_cls_token": true,'
        ' "pooling_mode_mean_tokens": false}'
    )
    cls = Embedder(EmbedderConfig(model=tmp_path, device="cpu"))
    assert cls.pooling == "cls" and cls.name == tmp_path.name
    text = "Permissions come from POSIX owner, group and mode bits."
    model, tok = cls.model, cls.tokenizer
    with torch.inference_mode():
        hidden = model(**tok([text], return_tensors="pt")).last_hidden_state[0, 0]
    expected = (hidden / hidden.norm()).numpy()
    np.testing.assert_allclose(cls.embed([text])[0], expected, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"max_length": 4}, {"max_length": 100_000}, {"device": "gpu"}],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        EmbedderConfig(**kwargs)  # type: ignore[arg-type]


# -- parity with the plain fp32 reference ------------------------------------------------------

# Lengths from 1 to past max_length, texts the tokenizer reduces to nothing, odd characters.
EDGE = [
    "",
    " ",
    "\n\n\t",
    ".",
    "GPU",
    "ünïcödé, 日本語 and emoji 🚀🧬 in one line",
    "How do I request a GPU node on the cluster?",
    "Quotas: 500 GB home, 20 TB project, scratch unlimited but purged after 30 days. " * 3,
    "Each Slurm array task reads SLURM_ARRAY_TASK_ID to pick its shard of the input. " * 12,
    "word " * 600,
    "x",
    "The sequencer writes FASTQ files to /data/genomics/runs/<date>/ within an hour of the run.",
]


def varied_texts(n: int, seed: int = 0, max_words: int = 400) -> list[str]:
    """n distinct texts of 1 to max_words words, in no particular order."""
    rng = np.random.default_rng(seed)
    words = ("gpu node slurm array job storage quota scratch backup sequencer imaging microscope "
             "permission group owner sidecar index chunk embed vector cluster partition").split()
    return [f"{i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, max_words)))) for i in range(n)]


def reference_vectors(folder: Path, texts: list[str], max_length: int, batch_size: int = 4) -> np.ndarray:
    """Mean-pooled unit vectors from the model in fp32, texts in input order, fixed batches, padded."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager").float().eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=1))
    return torch.cat(out).numpy()


def assert_parity(vectors: np.ndarray, reference: np.ndarray, min_cos: float) -> None:
    cosines = np.sum(vectors * reference, axis=1)
    assert cosines.min() >= min_cos, (cosines.min(), int(cosines.argmin()))
    # Each row is closest to its own reference: the output is in input order, not sorted order.
    # (Texts that tokenize alike, such as "" and " ", have equal references; skip those.)
    sims = vectors @ reference.T
    unique = [i for i in range(len(reference)) if (np.sum(reference @ reference[i] > 0.9999) == 1)]
    assert all(int(np.argmax(sims[i])) == i for i in unique)


@pytest.fixture(scope="session")
def reference_edge(embedder: Embedder) -> np.ndarray:
    return reference_vectors(embedder.folder, EDGE, embedder.max_length)


def test_matches_fp32_reference_for_every_text(embedder: Embedder, reference_edge: np.ndarray) -> None:
    vectors = embedder.embed(EDGE)
    assert vectors.dtype == np.float32 and np.isfinite(vectors).all()
    assert_parity(vectors, reference_edge, min_cos=0.9999)


def test_windows_and_threads_keep_parity_and_order(embedder: Embedder, reference_edge: np.ndarray) -> None:
    # Tiny windows: tokenization of later windows runs in the background while earlier ones embed.
    runner = embedder.runner
    saved = runner.window_texts, runner.first_window_texts
    runner.window_texts, runner.first_window_texts = 3, 2
    try:
        texts = EDGE * 2
        vectors = embedder.embed(texts)
    finally:
        runner.window_texts, runner.first_window_texts = saved
    assert_parity(vectors[: len(EDGE)], reference_edge, min_cos=0.9999)
    np.testing.assert_allclose(vectors[len(EDGE):], vectors[: len(EDGE)], atol=1e-5)


@pytest.mark.slow
def test_many_texts_of_many_lengths_match_reference(embedder: Embedder) -> None:
    texts = varied_texts(12, max_words=300)
    assert_parity(embedder.embed(texts), reference_vectors(embedder.folder, texts, embedder.max_length), 0.9999)


@pytest.mark.slow
def test_half_precision_on_cpu_is_honoured() -> None:
    # The same code path in bf16: the model runs in bf16, pooling and the result stay fp32.
    half = Embedder(EmbedderConfig(device="cpu", dtype="bfloat16"))
    assert half.dtype == "bfloat16" and next(half.model.parameters()).dtype == torch.bfloat16
    texts = EDGE[:9]  # the short ones: bf16 matrix products are slow on most CPUs
    vectors = half.embed(texts)
    assert vectors.dtype == np.float32
    assert_parity(vectors, reference_vectors(half.folder, texts, half.max_length), min_cos=0.99)


def test_token_budget_plans() -> None:
    lengths = np.array([5, 300, 40, 40, 7, 1000, 12, 40])
    batches = plan_batches(lengths, max_batch_tokens=100)
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(len(lengths)))  # every text exactly once
    for batch in batches:
        rows = lengths[batch]
        assert (np.diff(rows) <= 0).all()  # longest first within a batch
        assert len(batch) == 1 or len(batch) * rows[0] <= 100
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    # Short texts share a batch: 7 and 5 tokens fit the budget together.
    assert any({0, 4} <= set(b.tolist()) for b in batches)


def test_encoder_ids_match_the_tokenizer_and_pad_right(embedder: Embedder) -> None:
    encoder = TextEncoder(embedder.tokenizer, embedder.max_length)
    window = encoder.encode(EDGE)
    expected = embedder.tokenizer(EDGE, truncation=True, max_length=embedder.max_length)["input_ids"]
    assert [window.flat[s:s + n].tolist() for s, n in zip(window.starts, window.lengths, strict=True)] == expected
    # The shared tokenizer is not truncated by the encoder's copy (the chunker counts with it).
    assert len(embedder.tokenizer(EDGE[9])["input_ids"]) > embedder.max_length
    idx = plan_batches(window.lengths, 1 << 20)[0]
    out = np.full((len(idx), int(window.lengths[idx[0]])), -1, dtype=np.int64)
    pad_rows(window, idx, encoder.pad_id, out)
    for row, i in zip(out, idx, strict=True):
        n = window.lengths[i]
        assert row[:n].tolist() == expected[i] and (row[n:] == encoder.pad_id).all()


def test_prefetch_keeps_order_and_raises_where_the_producer_failed() -> None:
    assert list(prefetch(iter(range(100)), depth=3)) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise RuntimeError("tokenizer broke")

    got = []
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        for item in prefetch(failing(), depth=1):
            got.append(item)
    assert got == [1, 2]


def test_cpu_uses_one_device_and_no_worker(embedder: Embedder) -> None:
    assert embedder.devices == ("cpu",) and embedder.dtype == "float32"
    embedder.embed([f"note {i}" for i in range(300)])  # enough texts to split, were there more devices
    assert embedder._workers is None


@pytest.mark.slow  # a spawned process imports torch and loads the model: seconds
def test_worker_process_embeds_like_this_process(embedder: Embedder) -> None:
    # The multi-GPU machinery (spawned process, pipes, reassembly) on a CPU worker.
    spec = RunnerSpec(str(embedder.folder), "cpu", "float32", embedder.pooling, embedder.max_length,
                      embedder.max_batch_tokens)
    workers = EmbedWorkers([spec])
    try:
        texts = EDGE[:9] + varied_texts(4)
        workers.submit(0, texts)
        np.testing.assert_allclose(workers.result(0), embedder.embed(texts), atol=1e-5)
        workers.submit(0, [])  # an empty shard and a second call on the same worker
        assert workers.result(0).shape == (0, embedder.dim)
    finally:
        workers.close()


@pytest.mark.slow
def test_worker_that_cannot_load_reports_a_model_error(tmp_path: Path) -> None:
    spec = RunnerSpec(str(tmp_path), "cpu", "float32", "mean", 128, 1024)
    with pytest.raises(ModelError, match="failed to start"):
        EmbedWorkers([spec])


@pytest.mark.parametrize(
    "kwargs",
    [{"dtype": "fp8"}, {"devices": ()}, {"devices": ("cuda:0", "cuda:0")}, {"devices": ("cpu", "cuda:1")},
     {"devices": ("cuda:1",), "device": "cuda:0"}, {"max_batch_tokens": 10}],
)
def test_config_rejects_bad_new_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        EmbedderConfig(**kwargs)  # type: ignore[arg-type]


def test_config_accepts_a_device_list() -> None:
    config = EmbedderConfig(devices=["cuda:0", "cuda:1"])  # type: ignore[arg-type]
    assert config.devices == ("cuda:0", "cuda:1")


# -- on a GPU (the device machine) ---------------------------------------------------------------


def _gpu_model_folder() -> Path:
    """RAG_TEST_EMBEDDER_DIR (a copy of MiniLM carried to the GPU machine), else the packaged one."""
    folder = os.environ.get("RAG_TEST_EMBEDDER_DIR")
    if folder:
        return Path(folder)
    try:
        return default_embedder_path()
    except ModelError:
        pytest.skip("no embedder model here: set RAG_TEST_EMBEDDER_DIR")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_half_precision_matches_fp32_reference(dtype: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    folder = _gpu_model_folder()
    gpu = Embedder(EmbedderConfig(model=folder, device="cuda:0", devices=("cuda:0",), dtype=dtype, batch_size=16))
    assert gpu.dtype == dtype and next(gpu.model.parameters()).dtype == getattr(torch, dtype)
    texts = EDGE + varied_texts(300)
    reference = reference_vectors(folder, texts, gpu.max_length, batch_size=16)
    assert_parity(gpu.embed(texts), reference, min_cos=0.999)
    assert_parity(np.stack([gpu.embed_query(t) for t in EDGE]), reference[: len(EDGE)], min_cos=0.999)


@pytest.mark.gpu
def test_all_gpus_give_the_vectors_of_one() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two or more GPUs")
    folder = _gpu_model_folder()
    every = Embedder(EmbedderConfig(model=folder))
    one = Embedder(EmbedderConfig(model=folder, device="cuda:0", devices=("cuda:0",)))
    assert every.devices == tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    texts = varied_texts(3000, seed=1) + EDGE
    done: list[int] = []
    try:
        spread = every.embed(texts, progress=done.append)
        assert every._workers is not None and len(every._workers) == len(every.devices) - 1
        assert sum(done) == len(texts)
        assert np.sum(spread * one.embed(texts), axis=1).min() >= 0.999  # same rows, in the same order
        assert_parity(spread[-len(EDGE):], reference_vectors(folder, EDGE, every.max_length), min_cos=0.999)
    finally:
        every.close()


def test_ingest_commits_smaller_embed_calls_on_a_cpu_than_on_a_gpu():
    from ingest.embed.embedder import ingest_batch_chunks

    assert ingest_batch_chunks("cpu", None) == 256  # a killed CPU run redoes ~8 s of work at most
    assert ingest_batch_chunks("cuda:0", None) == 4096  # small calls leave a GPU idle
    assert ingest_batch_chunks("cuda", 512) == 512  # the setting wins
