"""HNSW and IVF stores beyond the exact path: approximate search, removal, retraining, files."""

from __future__ import annotations

import numpy as np
import pytest

from rag.errors import StoreError
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.faiss_ann import EXACT_BELOW
from retrieval.vectors.memory import MemoryIndex

DIM = 32
N = EXACT_BELOW + 2000  # large enough that broad allow-lists take the approximate path


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    ids = rng.choice(10**9, size=N, replace=False).astype(np.int64)
    return ids, _unit(rng, N), _unit(rng, 20)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["faiss-hnsw", "faiss-ivf"])
def test_broad_filter_recall_and_full_k(kind, data):
    ids, vecs, queries = data
    store, ref = make_vector_index(kind, DIM), MemoryIndex(DIM)
    store.add(ids, vecs)
    ref.add(ids, vecs)
    rng = np.random.default_rng(8)
    allowed = np.sort(rng.choice(ids, size=EXACT_BELOW + 1000, replace=False))
    recall = []
    for q in queries:
        got = store.search(q, 10, allowed)
        want = ref.search(q, 10, allowed)
        assert len(got) == 10
        assert {i for i, _ in got} <= set(allowed.tolist())
        recall.append(len({i for i, _ in got} & {i for i, _ in want}) / 10)
        # exact mode is exhaustive: identical to the reference
        assert [i for i, _ in store.search(q, 10, allowed, exact=True)] == [i for i, _ in want]
    assert np.mean(recall) >= 0.9
    assert store.num_approximate_searches == len(queries)  # the default threshold still routes here
    assert store.num_exact_searches == len(queries)  # the exact=True ones


@pytest.mark.parametrize("kind", ["faiss-hnsw", "faiss-ivf"])
def test_remove_replace_compact_and_reload(kind, data, tmp_path):
    ids, vecs, queries = data
    store = make_vector_index(kind, DIM)
    store.add(ids, vecs)
    gone = ids[: N // 2 + 1500]  # enough dead rows to trigger a compaction
    store.remove(gone)
    assert store.count() == N - len(gone)
    live = ids[len(gone):]
    allowed = np.concatenate([gone[:100], live])
    for q in queries[:5]:
        got = store.search(q, 10, allowed)
        assert not ({i for i, _ in got} & set(gone.tolist()))
        assert len(got) == 10
    # replacing a vector moves its id to the new vector
    target = int(live[0])
    store.add(np.array([target]), queries[:1])
    assert store.search(queries[0], 1, live)[0][0] == target
    path = tmp_path / f"x.{kind}"
    store.save(path)
    loaded = load_vector_index(kind, path, DIM)
    assert loaded.count() == store.count()
    for q in queries[:5]:
        assert loaded.search(q, 10, live, exact=True) == store.search(q, 10, live, exact=True)
    with pytest.raises(StoreError, match="cannot read"):
        (tmp_path / "bad").write_bytes(b"nope")
        load_vector_index(kind, tmp_path / "bad", DIM)


def test_ivf_trains_once_big_enough_and_retrains_as_it_grows(data):
    ids, vecs, _ = data
    store = make_vector_index("faiss-ivf", DIM)
    store.add(ids[:500], vecs[:500])
    assert not store.index.is_trained and store.probes is None  # too few rows: exhaustive search only
    store.add(ids[500:1500], vecs[500:1500])
    assert store.index.is_trained and store.trained_on == 1500
    first = store.probes  # each training measures its probe table (retrieval/vectors/ivf_probes.py)
    assert first is not None and max(first.nprobes) <= store.index.nlist
    store.add(ids[1500:], vecs[1500:])  # more than 4x: re-trained with more lists
    assert store.trained_on == N and store.index.ntotal == N
    assert store.probes is not None and store.probes is not first


@pytest.mark.parametrize("kind", ["memory", "faiss", "faiss-hnsw", "faiss-ivf"])
def test_a_repeated_allowed_id_is_one_hit(kind):
    # The reference store once returned such an id twice, filling two of the k places.
    rng = np.random.default_rng(11)
    vecs = _unit(rng, 50)
    store = MemoryIndex(DIM) if kind == "memory" else make_vector_index(kind, DIM)
    store.add(np.arange(50, dtype=np.int64), vecs)
    allowed = np.array([3, 3, 7, 7, 7, 9, 1000], dtype=np.int64)  # 1000: not stored
    hits = store.search(vecs[3], 5, allowed)
    assert sorted(i for i, _ in hits) == [3, 7, 9] and hits[0][0] == 3


def test_ivf_bulk_add_of_ascending_ids_keeps_last_wins_and_times_its_build(data):
    """A first add of ascending ids (a bulk load) skips the duplicate check and the relabelling: the
    same rows, labels and answers as one given out of order with a repeated id (the last vector wins)."""
    ids, vecs, queries = data
    order = np.argsort(ids)
    bulk = make_vector_index("faiss-ivf", DIM)
    bulk.add(ids[order], vecs[order])
    assert set(bulk.build_seconds) == {"train", "fill", "calibrate"}
    assert bulk.index.ntotal == N and bulk.count() == N
    assert bulk._label_of == dict(zip(ids[order].tolist(), range(N), strict=True))
    mixed = make_vector_index("faiss-ivf", DIM)
    stale = np.zeros((1, DIM), dtype=np.float32)
    mixed.add(np.concatenate([ids[order][:1], ids]), np.concatenate([stale, vecs]))  # ids[...][0] twice
    assert mixed.count() == N
    allowed = np.sort(ids)[: EXACT_BELOW + 1000]
    for q in queries[:5]:
        assert bulk.search(q, 10, allowed, exact=True) == mixed.search(q, 10, allowed, exact=True)
        assert {i for i, _ in bulk.search(q, 10, allowed)} <= set(allowed.tolist())


def test_ivf_file_of_the_earlier_writer_loads_and_a_cut_file_is_refused(data, tmp_path):
    """The file is the npz it always was: one written through faiss.serialize_index and np.savez (the
    earlier save) loads; a truncated one is a StoreError."""
    import faiss

    ids, vecs, queries = data
    store = make_vector_index("faiss-ivf", DIM)
    store.add(ids, vecs)
    old = tmp_path / "old.ivf"
    with open(old, "wb") as f:
        np.savez(f, kind=np.array(store.kind), index=faiss.serialize_index(store.index), vecs=store._vecs,
                 ext=store._ext, live=store._live, **store._extra_arrays())
    new = tmp_path / "new.ivf"
    store.save(new)
    with np.load(old) as a, np.load(new) as b:
        assert sorted(a.files) == sorted(b.files)
        assert all(np.array_equal(a[name], b[name]) for name in a.files)
    loaded = load_vector_index("faiss-ivf", old, DIM)
    assert loaded.index.ntotal == N and loaded.probes == store.probes
    allowed = np.sort(ids)[: EXACT_BELOW + 1000]
    for q in queries[:5]:
        assert loaded.search(q, 10, allowed) == store.search(q, 10, allowed)
    cut = tmp_path / "cut.ivf"
    cut.write_bytes(new.read_bytes()[: new.stat().st_size // 2])
    with pytest.raises(StoreError, match="cannot read"):
        load_vector_index("faiss-ivf", cut, DIM)
