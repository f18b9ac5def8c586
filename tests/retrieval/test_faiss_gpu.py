"""GPU IVF (retrieval/vectors/faiss_gpu.py): over-fetch, deepening and CPU fallback on a stand-in
without an ID selector; the `faiss_gpu` setting; and, with `-m gpu`, the real GPU index."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

import retrieval.vectors as vectors
from rag.errors import ConfigError
from retrieval.vectors import make_vector_index, set_faiss_gpu
from retrieval.vectors.faiss_ann import IvfIndex
from retrieval.vectors.faiss_gpu import MAX_DEPTH, GpuIvfIndex, SelectorlessCpu, gpu_available
from retrieval.vectors.memory import MemoryIndex

DIM = 16
N = 3000


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _stores(device, n: int = N, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = np.arange(10, 10 + n, dtype=np.int64)
    vecs = _unit(rng, n)
    ref, store = MemoryIndex(DIM), GpuIvfIndex(DIM, device, exact_below=0, min_rows=0)
    for s in (ref, store):
        s.add(ids, vecs)
    return rng, ids, vecs, ref, store


def test_broad_filters_are_answered_on_the_device_without_a_selector():
    rng, ids, _, ref, store = _stores(SelectorlessCpu())
    assert store.num_gpu_builds == 1 and isinstance(store.index, faiss.IndexIVFFlat)  # stored: a CPU index
    found = relevant = 0
    for _ in range(20):
        q = _unit(rng, 1)[0]
        allowed = np.sort(rng.choice(ids, size=N // 2, replace=False))
        got, want = store.search(q, 10, allowed), ref.search(q, 10, allowed)
        assert {i for i, _ in got} <= set(allowed.tolist())
        assert len(got) == 10
        found += len({i for i, _ in got} & {i for i, _ in want})
        relevant += len(want)
    assert store.num_gpu_searches == 20 and store.num_gpu_fallbacks == 0 and store.num_fallbacks == 0
    assert found / relevant >= 0.9
    assert store.replica.depths[0] == 10 * 4  # k * 2 / selectivity (50%)


def test_deepens_until_k_readable_hits():
    """The 100 rows nearest the query are unreadable: the first depth (15) holds none, so f doubles."""
    rng, ids, vecs, ref, store = _stores(SelectorlessCpu())
    q = _unit(rng, 1)[0]
    allowed = np.sort(ids[np.argsort(-(vecs @ q))[100:]])
    got, want = store.search(q, 5, allowed), ref.search(q, 5, allowed)
    assert store.num_deepenings >= 1 and store.num_gpu_searches == 1
    depths = store.replica.depths
    assert depths == [depths[0] * 2**i for i in range(len(depths))]
    assert {i for i, _ in got} <= set(allowed.tolist()) and len(got) == 5
    assert len({i for i, _ in got} & {i for i, _ in want}) >= 4


def test_selective_filters_fall_back_to_the_cpu_selector():
    """At 3 readable rows of 3000 the over-fetch would need far more than MAX_DEPTH: the CPU answers."""
    rng, ids, _, ref, store = _stores(SelectorlessCpu())
    allowed = np.array([ids[5], ids[700], ids[2900]])
    q = _unit(rng, 1)[0]
    got, want = store.search(q, 10, allowed), ref.search(q, 10, allowed)
    assert [i for i, _ in got] == [i for i, _ in want] and np.allclose([s for _, s in got], [s for _, s in want])
    assert store.num_gpu_fallbacks == 1 and store.replica.num_searches == 0
    assert 10 * 2 * (N / 3) > MAX_DEPTH


def test_the_stand_in_refuses_a_selector():
    """Were the index to pass its selector to a selector-less device, every search above would fail."""
    _, _, _, _, store = _stores(SelectorlessCpu())
    params = faiss.SearchParametersIVF(nprobe=4, sel=store._selector(np.arange(5)))
    with pytest.raises(RuntimeError, match="no ID selector"):
        store.replica.search(np.ones((1, DIM), dtype=np.float32), 5, params=params)


def test_rows_added_after_the_build_reach_the_replica_and_removed_ones_never_return():
    rng, ids, vecs, ref, store = _stores(SelectorlessCpu())
    q = _unit(rng, 1)[0]
    new_ids = np.array([99_001, 99_002], dtype=np.int64)
    for s in (ref, store):
        s.add(new_ids, np.stack([q, q]))  # exact matches of the query, added without a rebuild
        s.remove(ids[:100])
    assert store.num_gpu_builds == 1
    allowed = np.concatenate([ids, new_ids])  # also names the removed ids
    got = store.search(q, 10, allowed)
    assert [i for i, _ in got[:2]] == [99_001, 99_002]
    assert not {i for i, _ in got} & set(ids[:100].tolist())
    assert store.num_gpu_searches == 1


def test_saved_file_is_a_cpu_ivf_index(tmp_path):
    rng, ids, _, _, store = _stores(SelectorlessCpu())
    store.save(tmp_path / "c.ivf")
    plain = IvfIndex.load(tmp_path / "c.ivf", DIM, exact_below=0)  # a machine without a GPU
    again = GpuIvfIndex.load_with(tmp_path / "c.ivf", DIM, SelectorlessCpu(), exact_below=0, min_rows=0)
    q, allowed = _unit(rng, 1)[0], ids[::2]
    assert plain.search(q, 5, allowed, exact=True) == store.search(q, 5, allowed, exact=True)
    assert {i for i, _ in again.search(q, 5, allowed)} <= set(allowed.tolist())
    assert again.num_gpu_searches == 1  # the replica was made from the loaded CPU index


def test_below_min_rows_stays_on_the_cpu():
    rng = np.random.default_rng(3)
    store = GpuIvfIndex(DIM, SelectorlessCpu(), exact_below=0, min_rows=10_000)
    store.add(np.arange(N, dtype=np.int64), _unit(rng, N))
    store.search(_unit(rng, 1)[0], 5, np.arange(N // 2))
    assert store.num_gpu_builds == 0 and store.replica is None and store.num_approximate_searches == 1


def test_faiss_gpu_setting(monkeypatch):
    monkeypatch.setattr(vectors, "_faiss_gpu", "off")
    with pytest.raises(ValueError, match="auto, off, on"):
        set_faiss_gpu("sometimes")
    if not gpu_available():
        with pytest.raises(ConfigError, match="pip uninstall -y faiss-cpu"):
            set_faiss_gpu("on")
        set_faiss_gpu("auto")  # no GPU: auto is the CPU index
        assert type(make_vector_index("faiss-ivf", DIM)) is IvfIndex
    set_faiss_gpu("off")
    assert type(make_vector_index("faiss-ivf", DIM)) is IvfIndex


def test_settings_default_is_auto():
    from rag.settings import Settings

    assert Settings.model_fields["faiss_gpu"].default == "auto"


# -- the real GPU (`pytest -m gpu tests/retrieval/test_faiss_gpu.py` on a machine with faiss-gpu) --------

gpu = pytest.mark.skipif(not gpu_available(), reason="needs faiss-gpu and a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("share", [0.5, 0.1, 0.01])
def test_real_gpu_filtered_search_matches_reference(share):
    from retrieval.vectors.faiss_gpu import FaissGpu

    device = FaissGpu()
    rng, ids, _, ref, store = _stores(device, n=20_000, seed=7)
    assert store.num_gpu_builds == 1 and not isinstance(store.index, faiss.GpuIndex)  # kept on the host
    found = relevant = 0
    for _ in range(20):
        q = _unit(rng, 1)[0]
        allowed = np.sort(rng.choice(ids, size=int(len(ids) * share), replace=False))
        got, want = store.search(q, 10, allowed), ref.search(q, 10, allowed)
        assert {i for i, _ in got} <= set(allowed.tolist())  # never an unreadable chunk
        assert len(got) == 10  # never short of k
        found += len({i for i, _ in got} & {i for i, _ in want})
        relevant += len(want)
    assert found / relevant >= 0.9
    assert store.num_gpu_searches + store.num_gpu_fallbacks == 20


@pytest.mark.gpu
@gpu
def test_real_gpu_build_saves_a_cpu_index(tmp_path):
    from retrieval.vectors.faiss_gpu import FaissGpu

    rng, ids, _, _, store = _stores(FaissGpu(), n=20_000, seed=8)
    store.save(tmp_path / "g.ivf")
    plain = IvfIndex.load(tmp_path / "g.ivf", DIM, exact_below=0)
    q = _unit(rng, 1)[0]
    assert plain.search(q, 10, ids, exact=True) == store.search(q, 10, ids, exact=True)
    assert {i for i, _ in plain.search(q, 10, ids[::3])} <= set(ids[::3].tolist())
