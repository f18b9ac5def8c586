"""The test suite's forward memo (rag.forward_memo): a hit is the stored array, anything else misses."""

import os
import stat

import numpy as np
import pytest
import torch

from rag import forward_memo
from rag.forward_memo import ENV, batch_key, memo_folder, memoized, model_fingerprint


class Counting:
    """compute() that counts its calls and returns a fresh array each time."""

    def __init__(self, value: float) -> None:
        self.calls, self.value = 0, value

    def __call__(self) -> np.ndarray:
        self.calls += 1
        return np.full((2, 3), self.value + self.calls, dtype=np.float32)


def test_off_unless_the_variable_names_a_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert memo_folder() is None
    monkeypatch.setenv(ENV, "  ")
    assert memo_folder() is None
    monkeypatch.setenv(ENV, str(tmp_path))
    assert memo_folder() == tmp_path


def test_a_hit_returns_the_stored_array_without_computing(tmp_path):
    compute = Counting(1.0)
    first = memoized(tmp_path, "ab" * 32, compute)
    second = memoized(tmp_path, "ab" * 32, compute)
    assert compute.calls == 1
    assert second.dtype == first.dtype and np.array_equal(second, first)


def test_files_are_owner_only(tmp_path):
    memoized(tmp_path, "cd" * 32, Counting(0.0))
    (sub,) = tmp_path.iterdir()
    (stored,) = sub.iterdir()
    assert stat.S_IMODE(sub.stat().st_mode) == 0o700
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert not list(sub.glob("*.tmp"))  # written to a temporary name, then renamed


def test_keys_differ_for_any_input_model_or_setting():
    ids = np.array([[101, 7, 102, 0]], dtype=np.int64)
    lengths = np.array([3], dtype=np.int64)
    base = batch_key("model-a", "encoder|mean", [ids, lengths])
    assert base == batch_key("model-a", "encoder|mean", [ids.copy(), lengths.copy()])
    other_ids = ids.copy()
    other_ids[0, 1] = 8
    variants = [
        batch_key("model-b", "encoder|mean", [ids, lengths]),  # another model
        batch_key("model-a", "encoder|cls", [ids, lengths]),  # another pooling
        batch_key("model-a", "encoder|mean", [other_ids, lengths]),  # one token differs
        batch_key("model-a", "encoder|mean", [ids, np.array([4], dtype=np.int64)]),  # padding counted
        batch_key("model-a", "encoder|mean", [ids.astype(np.int32), lengths]),  # dtype counted
        batch_key("model-a", "encoder|mean", [ids.reshape(4, 1), lengths]),  # shape counted
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_model_fingerprint_tells_weights_apart():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    same = torch.nn.Linear(4, 3)
    same.load_state_dict(model.state_dict())
    assert model_fingerprint(model) == model_fingerprint(same)
    with torch.no_grad():
        same.bias[-1] += 1e-3  # the last element of the last parameter: the tail sample sees it
    assert model_fingerprint(model) != model_fingerprint(same)
    assert model_fingerprint(model) != model_fingerprint(model.to(torch.float64))


def test_a_folder_that_cannot_be_used_means_computing(tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")  # mkdir under a file fails: nothing stored, the result still returned
    compute = Counting(5.0)
    assert np.array_equal(memoized(blocked, "ef" * 32, compute), np.full((2, 3), 6.0, np.float32))
    assert np.array_equal(memoized(blocked, "ef" * 32, compute), np.full((2, 3), 7.0, np.float32))
    assert compute.calls == 2


def test_a_half_written_file_is_recomputed(tmp_path):
    key = "12" * 32
    (tmp_path / key[:2]).mkdir()
    (tmp_path / key[:2] / f"{key}.npy").write_bytes(b"\x93NUMPY truncated")
    compute = Counting(0.0)
    result = memoized(tmp_path, key, compute)
    assert compute.calls == 1
    assert np.array_equal(memoized(tmp_path, key, compute), result)  # and stored whole this time
    assert compute.calls == 1


@pytest.mark.usefixtures("without_forward_memo")
def test_embedder_hits_equal_a_fresh_computation(tmp_path, monkeypatch):
    """The packaged embedder through the memo: first and repeated passes equal the memo-free ones."""
    from ingest.embed.embedder import Embedder, EmbedderConfig

    texts = ["centrifuge the sample at 4 degrees", "the cluster's scratch is purged weekly", "short"]
    plain = Embedder(EmbedderConfig(device="cpu")).embed(texts)
    monkeypatch.setenv(ENV, str(tmp_path))
    calls = []
    real = forward_memo.memoized
    monkeypatch.setattr("ingest.embed.runner.memoized",
                        lambda folder, key, compute: calls.append(key) or real(folder, key, compute))
    embedder = Embedder(EmbedderConfig(device="cpu"))
    stored = embedder.embed(texts)
    again = embedder.embed(texts)
    assert calls and any(tmp_path.rglob("*.npy"))
    assert np.array_equal(stored, plain) and np.array_equal(again, plain)
    assert os.environ[ENV] == str(tmp_path)


@pytest.mark.usefixtures("without_forward_memo")
def test_reranker_hits_equal_a_fresh_computation(tmp_path, monkeypatch, model_cache):
    """The packaged cross-encoder through the memo: scores equal the memo-free ones exactly."""
    from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir

    folder = resolve_reranker_dir(None, model_cache)
    pairs = [("how cold is the centrifuge", "spin at 4 degrees for ten minutes"),
             ("how cold is the centrifuge", "scratch space is purged weekly")]
    plain = CrossEncoderReranker(folder, device="cpu", dtype="float32").score_pairs(pairs)
    monkeypatch.setenv(ENV, str(tmp_path))
    reranker = CrossEncoderReranker(folder, device="cpu", dtype="float32")
    stored = reranker.score_pairs(pairs)
    assert any(tmp_path.rglob("*.npy"))
    again = reranker.score_pairs(pairs)
    assert stored == plain and again == plain
