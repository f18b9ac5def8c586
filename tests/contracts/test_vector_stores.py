"""Contract suite: every vector store returns the reference store's ACL-filtered top-k."""

from __future__ import annotations

import numpy as np
import pytest

from rag.errors import StoreError
from retrieval.stores import make_store
from retrieval.stores.faiss import FaissStore
from retrieval.stores.memory import MemoryStore

DIM = 16
KINDS = ["memory", "faiss", "faiss-hnsw", "faiss-ivf"]


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(params=KINDS)
def store(request):
    return make_store(request.param, DIM)


def test_filtered_topk_matches_reference(store):
    rng = np.random.default_rng(0)
    ids = np.arange(100, 400, dtype=np.int64)
    vecs = _unit(rng, len(ids))
    ref = MemoryStore(DIM)
    ref.add(ids, vecs)
    store.add(ids, vecs)
    for trial in range(20):
        allowed = np.sort(rng.choice(ids, size=int(rng.integers(1, 300)), replace=False))
        q = _unit(rng, 1)[0]
        k = int(rng.integers(1, 20))
        got = store.search(q, k, allowed)
        want = ref.search(q, k, allowed)
        assert [i for i, _ in got] == [i for i, _ in want], trial
        assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-5)
        assert set(i for i, _ in got) <= set(allowed.tolist())


def test_empty_allow_list_returns_nothing(store):
    rng = np.random.default_rng(1)
    store.add(np.arange(10, dtype=np.int64), _unit(rng, 10))
    assert store.search(_unit(rng, 1)[0], 5, np.empty(0, dtype=np.int64)) == []


def test_k_larger_than_allowed_set(store):
    rng = np.random.default_rng(2)
    store.add(np.arange(50, dtype=np.int64), _unit(rng, 50))
    got = store.search(_unit(rng, 1)[0], 10, np.array([3, 7, 11], dtype=np.int64))
    assert sorted(i for i, _ in got) == [3, 7, 11]


def test_upsert_replaces_and_remove_deletes(store):
    rng = np.random.default_rng(3)
    vecs = _unit(rng, 3)
    store.add(np.array([1, 2, 3], dtype=np.int64), vecs)
    store.add(np.array([2], dtype=np.int64), vecs[:1])  # id 2 now points where id 1 does
    assert store.count() == 3
    got = store.search(vecs[0], 2, np.array([1, 2, 3], dtype=np.int64))
    assert {i for i, _ in got} == {1, 2}
    store.remove(np.array([1, 99], dtype=np.int64))
    assert store.count() == 2
    got = store.search(vecs[0], 3, np.array([1, 2, 3], dtype=np.int64))
    assert 1 not in {i for i, _ in got}


def test_empty_store(store):
    assert store.count() == 0
    assert store.search(np.ones(DIM, dtype=np.float32), 5, np.array([1], dtype=np.int64)) == []


def test_dimension_mismatch_is_a_clear_error(store):
    with pytest.raises(StoreError, match="shape"):
        store.add(np.array([1], dtype=np.int64), np.ones((1, DIM + 1), dtype=np.float32))
    with pytest.raises(StoreError, match="shape"):
        store.search(np.ones(DIM + 2, dtype=np.float32), 3, np.array([1], dtype=np.int64))


def test_faiss_save_and_load_roundtrip(tmp_path):
    rng = np.random.default_rng(4)
    store = FaissStore(DIM)
    vecs = _unit(rng, 20)
    store.add(np.arange(20, dtype=np.int64), vecs)
    store.save(tmp_path / "x.faiss")
    loaded = FaissStore.load(tmp_path / "x.faiss", DIM)
    allowed = np.arange(0, 20, 2, dtype=np.int64)
    assert loaded.search(vecs[4], 3, allowed) == store.search(vecs[4], 3, allowed)
    (tmp_path / "bad.faiss").write_bytes(b"not an index")
    with pytest.raises(StoreError, match="cannot read"):
        FaissStore.load(tmp_path / "bad.faiss", DIM)
