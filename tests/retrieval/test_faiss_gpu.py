"""GPU IVF (retrieval/vectors/faiss_gpu.py): over-fetch, deepening and CPU fallback on a stand-in
without an ID selector; the `faiss_gpu` setting, held per store set (`CollectionStores`, `Rag`)
and honoured by ingest, queries, reloads and rebuilds; and, with `-m gpu`, the real GPU index."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from rag.errors import ConfigError
from rag.types import Chunk, Document
from retrieval.records import BuildSpec
from retrieval.stores import CollectionStores
from retrieval.stores.embedded.catalog import Catalog
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.faiss_ann import IvfIndex
from retrieval.vectors.faiss_gpu import (
    AUTO_MIN_ROWS,
    MAX_DEPTH,
    GpuIvfIndex,
    GpuPlacement,
    SelectorlessCpu,
    _SelectorlessReplica,
    gpu_available,
)
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
    _, ids, _, _, store = _stores(SelectorlessCpu())
    params = faiss.SearchParametersIVF(nprobe=4, sel=store._selector(store.rows_for(ids[:5])))
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


def test_the_device_build_measures_the_same_probe_table_and_files_keep_it(tmp_path):
    """The probe policy is IvfIndex's: measured on the CPU copy after a device build (the stand-in
    refuses selectors, so calibrating on the replica would fail), capped at MAX_DEPTH on the device."""
    rng, ids, _, _, store = _stores(SelectorlessCpu())
    assert store.probes is not None and store.probes.nprobes[0] >= 1
    assert type(store)._nprobe is IvfIndex._nprobe
    cpu = IvfIndex(DIM, exact_below=0)
    cpu.add(ids, store._vecs[:len(ids)])
    # same rows, same k-means, same seed: the measurement a CPU build makes
    assert (cpu.probes.fractions, cpu.probes.nprobes) == (store.probes.fractions, store.probes.nprobes)
    store.save(tmp_path / "c.ivf")
    again = GpuIvfIndex.load_with(tmp_path / "c.ivf", DIM, SelectorlessCpu(), exact_below=0, min_rows=0)
    assert again.probes == store.probes
    q, allowed = _unit(rng, 1)[0], ids[::10]
    assert len(again.search(q, 10, allowed)) == 10 and again.num_gpu_searches == 1


def test_below_min_rows_stays_on_the_cpu():
    rng = np.random.default_rng(3)
    store = GpuIvfIndex(DIM, SelectorlessCpu(), exact_below=0, min_rows=10_000)
    store.add(np.arange(N, dtype=np.int64), _unit(rng, N))
    store.search(_unit(rng, 1)[0], 5, np.arange(N // 2))
    assert store.num_gpu_builds == 0 and store.replica is None and store.num_approximate_searches == 1


def test_make_and_load_take_the_placement_they_are_given(tmp_path):
    """No process-wide switch: each call gets the index its own `gpu` argument asks for."""
    standin = GpuPlacement(SelectorlessCpu(), min_rows=0)
    on = make_vector_index("faiss-ivf", DIM, gpu=standin)
    off = make_vector_index("faiss-ivf", DIM)
    assert type(on) is GpuIvfIndex and on.min_rows == 0 and on.device is standin.device
    assert type(off) is IvfIndex
    assert type(make_vector_index("faiss-ivf", DIM, exact_below=0, gpu=GpuPlacement(SelectorlessCpu()))) is GpuIvfIndex
    assert make_vector_index("faiss-ivf", DIM, gpu=GpuPlacement(SelectorlessCpu())).min_rows == AUTO_MIN_ROWS
    assert type(make_vector_index("faiss-hnsw", DIM, gpu=standin)).__name__ == "HnswIndex"  # only IVF uses it
    rng = np.random.default_rng(5)
    on.add(np.arange(N, dtype=np.int64), _unit(rng, N))
    on.save(tmp_path / "c.ivf")
    again = load_vector_index("faiss-ivf", tmp_path / "c.ivf", DIM, exact_below=0, gpu=standin)
    plain = load_vector_index("faiss-ivf", tmp_path / "c.ivf", DIM, exact_below=0)
    assert type(again) is GpuIvfIndex and type(plain) is IvfIndex
    again.search(_unit(rng, 1)[0], 5, np.arange(N // 2))
    assert again.num_gpu_searches == 1  # a replica of the loaded lists answered
    with pytest.raises(ValueError, match="min_rows"):
        GpuPlacement(SelectorlessCpu(), min_rows=-1)


def _write(store, n_docs: int, rng: np.random.Generator, chunks_per_doc: int = 10) -> None:
    """`n_docs` documents of `chunks_per_doc` chunks, every other one readable by group:a, the rest by group:b."""
    for d in range(n_docs):
        key, acl = f"doc{d:04d}", frozenset({"group:a" if d % 2 == 0 else "group:b"})
        doc = Document(key=key, source=f"/lab/{key}.md", text=key, content_hash=key, acl=acl)
        chunks = [Chunk(document_key=key, index=i, text=f"{key} part {i}", num_tokens=3)
                  for i in range(chunks_per_doc)]
        store.replace_document(doc, acl, chunks, _unit(rng, chunks_per_doc))


def _stores_of(home, faiss_gpu) -> tuple[CollectionStores, Catalog]:
    catalog = Catalog(home / "catalog.sqlite")
    return CollectionStores("faiss-ivf", lambda: catalog, home / "indexes", lambda: "unused",
                            faiss_gpu=faiss_gpu), catalog


SPEC = BuildSpec("test-embedder", "fp-1", DIM, {"max_tokens": 64})


def test_two_store_sets_in_one_process_keep_their_own_setting(tmp_path):
    """Like two `Rag` objects in a notebook: one set on the (stand-in) GPU, one on the CPU, opened in
    either order, over the same data directory; ingest, queries and reloads each honour their own."""
    standin = GpuPlacement(SelectorlessCpu(), min_rows=0)
    gpu_set, gpu_catalog = _stores_of(tmp_path, standin)
    cpu_set, cpu_catalog = _stores_of(tmp_path, "off")
    rng = np.random.default_rng(11)
    try:
        ingest = gpu_set.for_ingest("lab", SPEC)  # ingest through the GPU set: k-means and fill on the device
        _write(ingest, 150, rng)  # 1,500 chunks: over IvfIndex.MIN_TRAIN, so lists are trained
        ingest.save()
        gpu_live = gpu_set.open("lab")
        assert type(gpu_live.vectors) is GpuIvfIndex and gpu_live.vectors.num_gpu_builds >= 1
        assert isinstance(gpu_live.vectors.replica, _SelectorlessReplica)

        cpu_live = cpu_set.open("lab")  # opened after the GPU set, and it stays on the CPU
        assert type(cpu_live.vectors) is IvfIndex
        q = _unit(rng, 1)[0]
        for live in (gpu_live, cpu_live):
            live.vectors.exact_below = 0  # search the lists, not the exact path of a small collection
        got_gpu, got_cpu = gpu_live.search(q, 10, ["group:a"]), cpu_live.search(q, 10, ["group:a"])
        assert gpu_live.vectors.num_gpu_searches == 1 and cpu_live.vectors.num_approximate_searches == 1
        readable = set(gpu_live.allowed_ids(["group:a"]).tolist())
        assert len(got_gpu) == len(got_cpu) == 10 and {i for i, _ in got_gpu + got_cpu} <= readable

        # The CPU set ingests too, and the GPU set's next read reloads the new version on its device.
        more = cpu_set.for_ingest("lab", SPEC)
        _write(more, 10, rng)
        more.save()
        assert type(cpu_set.open("lab").vectors) is IvfIndex
        gpu_live.refresh()
        assert type(gpu_live.vectors) is GpuIvfIndex  # loaded from the file the CPU set saved
        gpu_live.vectors.exact_below = 0
        assert {i for i, _ in gpu_live.search(q, 10, ["group:b"])} <= set(gpu_live.allowed_ids(["group:b"]).tolist())
        assert gpu_live.vectors.num_gpu_searches == 1
    finally:
        for s in (gpu_set, cpu_set):
            s.close()
        gpu_catalog.close()
        cpu_catalog.close()


def test_a_rebuild_builds_where_its_store_set_says(tmp_path):
    gpu_set, catalog = _stores_of(tmp_path, GpuPlacement(SelectorlessCpu(), min_rows=0))
    rng = np.random.default_rng(12)
    build = None
    try:
        first = gpu_set.for_ingest("lab", SPEC)
        _write(first, 2, rng)
        first.save()
        build = gpu_set.for_ingest("lab", BuildSpec("test-embedder", "fp-1", DIM, {"max_tokens": 32}))
        assert build.notice  # a next version, built beside the live one
        _write(build, 110, rng)
        assert type(build.build.vectors) is GpuIvfIndex and build.build.vectors.num_gpu_builds >= 1
        build.save()
        assert build.finish().switched
        live = gpu_set.open("lab")
        live.refresh()
        assert type(live.vectors) is GpuIvfIndex and live.vectors.count() == 1100
    finally:
        if build is not None:
            getattr(build.build, "close", lambda: None)()
        gpu_set.close()
        catalog.close()


def test_faiss_gpu_modes(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="auto, off, on"):
        _stores_of(tmp_path, "sometimes")
    off, catalog = _stores_of(tmp_path, "off")
    catalog.create_collection("lab", "test-embedder", "fp-1", DIM, {})
    assert type(off.open("lab").vectors) is IvfIndex
    off.close()
    if not gpu_available():
        with pytest.raises(ConfigError, match="pip uninstall -y faiss-cpu"):
            _stores_of(tmp_path, "on")  # at construction (startup), not at the first large build
        auto, _ = _stores_of(tmp_path, "auto")
        assert type(auto.open("lab").vectors) is IvfIndex  # no GPU: auto is the CPU index
        auto.close()
    # A set of another kind never resolves the setting (no GPU resources for a flat or pgvector store).
    import retrieval.vectors.faiss_gpu as faiss_gpu

    monkeypatch.setattr(faiss_gpu, "resolve_placement", lambda mode: pytest.fail("resolved for a flat store"))
    flat = CollectionStores("faiss", lambda: catalog, tmp_path / "indexes", lambda: "unused", faiss_gpu="auto")
    assert flat.open("lab").vectors.kind == "flat"
    flat.close()
    catalog.close()


def test_each_rag_holds_its_own_faiss_gpu(tmp_path):
    from rag.pipeline import Rag
    from rag.settings import load_settings

    if not gpu_available():
        with pytest.raises(ConfigError, match="pip uninstall -y faiss-cpu"):
            Rag(load_settings(home=tmp_path / "a", store="faiss-ivf", faiss_gpu="on"))
    on_cpu = Rag(load_settings(home=tmp_path / "b", store="faiss-ivf", faiss_gpu="off"))
    auto = Rag(load_settings(home=tmp_path / "c", store="faiss-ivf", faiss_gpu="auto"))
    try:
        assert on_cpu.stores._faiss_gpu == "off" and auto.stores._faiss_gpu == "auto"
        for rag in (on_cpu, auto):
            rag.catalog.create_collection("lab", "test-embedder", "fp-1", DIM, {})
        assert type(on_cpu.stores.open("lab").vectors) is IvfIndex
        want = GpuIvfIndex if gpu_available() else IvfIndex
        assert type(auto.stores.open("lab").vectors) is want
    finally:
        on_cpu.close()
        auto.close()


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
