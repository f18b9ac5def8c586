"""The embedder on the packaged all-MiniLM-L6-v2: shapes, order, truncation, relevance, errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ingest.embed import (
    DEFAULT_EMBEDDER_NAME,
    Embedder,
    EmbedderConfig,
    default_embedder_path,
)
from rag.errors import ModelError

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
    assert done == [3, 3, 1]


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
