"""Row sets: ACL cases the main suite left open (found by mutating retrieval/vectors and the collection).

Each test fails on a plausible bug that lets a row set admit a removed or unknown row, a device skip the
post-filter, or one principal's cached union answer for another; all run on real Faiss indexes.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.faiss_gpu import GpuIvfIndex, SelectorlessCpu, _SelectorlessReplica
from retrieval.vectors.row_sets import union
from tests.retrieval.test_row_sets import DIM, _unit  # the sibling suite's 16-d unit vectors

N = 2000  # past IvfIndex.MIN_TRAIN: the IVF kinds have lists


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    ids = rng.choice(10**9, size=N, replace=False).astype(np.int64)  # sparse ids: the sorted lookup
    return ids, _unit(rng, N), _unit(rng, 4)


_KINDS = {
    "hnsw-exact": lambda: make_vector_index("faiss-hnsw", DIM),
    "hnsw-graph": lambda: make_vector_index("faiss-hnsw", DIM, 0),
    "ivf-exact": lambda: make_vector_index("faiss-ivf", DIM),
    "gpu-ivf-replica": lambda: GpuIvfIndex(DIM, SelectorlessCpu(), exact_below=0, min_rows=1),
}


@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_set_made_before_a_removal_never_admits_the_removed_rows(kind, data):
    """A removal too small to compact still makes older sets stale (the GPU replica keeps removed rows)."""
    ids, vecs, queries = data
    store = _KINDS[kind]()
    store.add(ids, vecs)
    readable = ids[: N // 2]
    token_sets = [store.rows_for(readable[:300]), store.rows_for(readable[300:])]
    held_union = union(token_sets, token_sets[0].generation, token_sets[0].n)  # as the collection caches it
    gone = readable[::7]  # 143 rows: far below a compaction
    store.remove(gone)
    allowed = set(readable.tolist()) - set(gone.tolist())
    for given in (token_sets, [held_union]):
        for q in queries:
            hits = store.search_rows(q, 10, given)
            assert len(hits) == 10 and {i for i, _ in hits} <= allowed
        everything = store.search_rows(queries[0], N, given, exact=True)
        assert {i for i, _ in everything} == allowed


@pytest.mark.parametrize("kind", ["faiss-hnsw", "faiss-ivf"])
def test_a_set_made_before_an_add_still_answers_with_the_added_rows(kind, data):
    """An id allowed before its vector arrived is found once it is added (the set is remade, not refused)."""
    ids, vecs, queries = data
    store = make_vector_index(kind, DIM)
    store.add(ids[:1500], vecs[:1500])
    rows = store.rows_for(ids[1000:])  # 500 present, 500 still to come
    store.add(ids[1500:], vecs[1500:])  # new ids only: no row is replaced or removed
    for q in queries:
        assert store.search_rows(q, 10, [rows]) == store.search(q, 10, ids[1000:])
    assert len(store.search_rows(queries[0], N, [rows], exact=True)) == 1000


@pytest.mark.parametrize("kind", ["faiss-hnsw", "faiss-ivf"])
def test_allowed_ids_missing_from_a_dense_id_range_admit_nothing(kind):
    """Consecutive ids use a lookup table; an allowed id in one of its holes maps to no row."""
    present = np.concatenate([np.arange(100, 600), np.arange(700, 1800)]).astype(np.int64)
    rng = np.random.default_rng(12)
    store = make_vector_index(kind, DIM)
    store.add(present, _unit(rng, len(present)))
    store.remove(present[:8])  # removed ids are holes too
    q = _unit(rng, 1)[0]
    for hole in ([650], [100, 107], [600, 699, 650]):
        assert store.rows_for(np.array(hole)).count == 0
        assert store.search(q, 10, np.array(hole, dtype=np.int64)) == []
    mixed = np.array([650, 1799, 100], dtype=np.int64)  # a hole, the last row, a removed row
    assert [i for i, _ in store.search(q, 10, mixed)] == [1799]
    broad = np.concatenate([np.arange(600, 700), present[1::3]])  # a bitmap set, with 100 hole ids
    got = {i for i, _ in store.search(q, len(present), broad, exact=True)}
    assert got == set(present[8:][np.isin(present[8:], broad)].tolist())


def test_a_reloaded_index_does_not_take_the_original_instances_sets(data, tmp_path):
    """After a reload, one removal must not make the loaded instance's generation look like the original's."""
    ids, vecs, queries = data
    store = make_vector_index("faiss-hnsw", DIM)
    store.add(ids, vecs)
    old = store.rows_for(ids[:500])
    store.save(tmp_path / "x.hnsw")
    other = load_vector_index("faiss-hnsw", tmp_path / "x.hnsw", DIM)
    other.remove(ids[:10])
    got = other.search_rows(queries[0], N, [old], exact=True)
    assert {i for i, _ in got} == set(ids[10:500].tolist())


class _SelectorIgnoringReplica(_SelectorlessReplica):
    """A device replica that says it filters by selector but does not (a faulty cuVS build)."""

    def search(self, query: np.ndarray, k: int, params: faiss.SearchParametersIVF | None = None):
        nprobe = params.nprobe if params is not None else 1
        return super().search(query, k, params=faiss.SearchParametersIVF(nprobe=nprobe))


class _SelectorIgnoringDevice(SelectorlessCpu):
    honours_selector = True

    def to_device(self, index: faiss.Index) -> _SelectorIgnoringReplica:
        return _SelectorIgnoringReplica(index)


def test_a_device_that_claims_a_selector_is_still_post_filtered(data):
    ids, vecs, queries = data
    store = GpuIvfIndex(DIM, _SelectorIgnoringDevice(), exact_below=0, min_rows=1)
    store.add(ids, vecs)
    allowed = ids[::5]
    for q in queries:
        hits = store.search(q, 10, allowed)
        assert len(hits) == 10 and {i for i, _ in hits} <= set(allowed.tolist())
    assert store.num_gpu_searches > 0  # the device answered (its answers were filtered)


def _doc(key: str) -> Document:
    return Document(key=key, source=f"/src/{key}", text=key, content_hash=f"h-{key}", acl=None, title=key)


def test_principals_sharing_a_first_token_do_not_share_a_cached_union(tmp_path):
    """bob (g1) asks after alice (g1, g2): the union cached for alice must not answer bob, nor the reverse."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("docs", "test-embedder", "fp1", DIM, {"max_tokens": 100})
    coll = EmbeddedCollection(catalog, info, None, "faiss-hnsw", exact_below=0)
    rng = np.random.default_rng(13)
    coll.batch_writes = True
    for i in range(60):
        chunk = Chunk(document_key=f"d{i}", index=0, text=f"d{i}", num_tokens=1)
        coll.replace_document(_doc(f"d{i}"), frozenset({f"group:g{i % 3}"}), [chunk], _unit(rng, 1))
    coll.flush()
    alice = store_filter(Principal("alice", frozenset({"g1", "g2"})))
    bob = store_filter(Principal("bob", frozenset({"g1"})))
    q = _unit(rng, 1)[0]
    try:
        for first, second, second_groups in ((alice, bob, {1}), (bob, alice, {1, 2})):
            coll.search(q, 60, first)
            hits = coll.search(q, 60, second)
            keys = {r.document_key for r in coll.chunk_records([i for i, _ in hits]).values()}
            assert {int(k[1:]) % 3 for k in keys} == second_groups and len(keys) == 20 * len(second_groups)
    finally:
        catalog.close()
