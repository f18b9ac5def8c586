"""Row sets: per-token allow-lists translated once, unioned per query, never stale."""

from __future__ import annotations

import numpy as np
import pytest

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Chunk, Document
from retrieval.stores.embedded import collection as collection_module
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.faiss_ann import EXACT_BELOW
from retrieval.vectors.faiss_gpu import GpuIvfIndex, SelectorlessCpu
from retrieval.vectors.memory import MemoryIndex
from retrieval.vectors.row_sets import RowSet, union, unique_sorted

DIM = 16


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# -- the set itself ----------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[], [5], [3, 3, 3], [9, -2, 9, 0, 7, -2], list(range(1000, 0, -1))])
def test_unique_sorted_is_np_unique(values):
    a = np.array(values, dtype=np.int64)
    assert unique_sorted(a).tolist() == np.unique(a).tolist()
    assert unique_sorted(a).dtype == np.int64


def test_unique_sorted_on_random_ids():
    a = np.random.default_rng(0).integers(-10**12, 10**12, 50_000)
    a = np.concatenate([a, a[::3]])
    assert np.array_equal(unique_sorted(a), np.unique(a))


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 15, 16, 17, 500, 1000])
def test_sparse_and_dense_sets_hold_exactly_their_labels(count):
    n = 1003  # not a multiple of 8: the last byte is partial
    rng = np.random.default_rng(count)
    labels = rng.choice(n, size=count, replace=False)
    given = np.concatenate([labels, labels[: count // 2]])  # repeats, as from an allow-list with repeats
    rows = RowSet.of_labels(np.empty(0, np.int64), 1, n, given)
    assert (rows.bits is not None) == (256 * len(given) >= n)  # 4 labels of 1003 rows: a bitmap
    assert rows.count == count
    assert rows.sorted_labels().tolist() == sorted(labels.tolist())
    probe = np.arange(-5, n + 20)  # outside [0, n) is never contained
    assert set(probe[rows.contains(probe)].tolist()) == set(labels.tolist())
    unpacked = np.unpackbits(rows.packed(), count=n, bitorder="little")
    assert set(np.flatnonzero(unpacked).tolist()) == set(labels.tolist())
    assert not np.unpackbits(rows.packed(), bitorder="little")[n:].any()


def test_union_mixes_sparse_and_dense_parts():
    n = 5000
    rng = np.random.default_rng(1)
    picks = [rng.choice(n, size=s, replace=False) for s in (3, 12, 40, 900, 2500, 0)]
    parts = [RowSet.of_labels(np.empty(0, np.int64), 7, n, p) for p in picks]
    assert [p.bits is not None for p in parts] == [False, False, True, True, True, False]
    for subset in ([0], [0, 1], [0, 1, 5], [2, 3], [0, 2], [0, 1, 2, 3, 4, 5], [5], [3, 4], [1, 4]):
        want = set().union(*(set(picks[i].tolist()) for i in subset))
        got = union([parts[i] for i in subset], 7, n)
        assert got.count == len(want)
        assert set(got.sorted_labels().tolist()) == want
        if len(subset) > 1:
            assert got.parts == tuple(parts[i] for i in subset)  # what a stale union is remade from


def test_union_refuses_sets_of_another_generation():
    a = RowSet.of_labels(np.empty(0, np.int64), 1, 100, np.arange(3))
    b = RowSet.of_labels(np.empty(0, np.int64), 2, 100, np.arange(3))
    with pytest.raises(ValueError, match="generation"):
        union([a, b], 2, 100)


# -- in the indexes ----------------------------------------------------------------------------

N = EXACT_BELOW + 6000  # broad tokens take the approximate path


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    ids = rng.choice(10**9, size=N, replace=False).astype(np.int64)
    token = rng.integers(0, 6, N)  # six ACL tokens, one per row
    return ids, _unit(rng, N), _unit(rng, 12), token


def _stores():
    return [make_vector_index("faiss-hnsw", DIM), make_vector_index("faiss-ivf", DIM),
            GpuIvfIndex(DIM, SelectorlessCpu(), min_rows=1)]


@pytest.mark.slow
def test_search_over_token_sets_equals_search_over_their_union(data):
    """Per-token sets unioned in the index answer as the union of ids does, on every path."""
    ids, vecs, queries, token = data
    for store in _stores():
        store.add(ids, vecs)
        parts = {t: store.rows_for(ids[token == t]) for t in range(6)}
        tiny = store.rows_for(ids[:5])
        for held in ([0], [0, 1], [0, 1, 2, 3, 4, 5], [5, 2]):
            allowed = ids[np.isin(token, held)]
            for q in queries:
                got = store.search_rows(q, 10, [parts[t] for t in held])
                assert got == store.search(q, 10, allowed), type(store).__name__
            # a selective token beside a broad one, and the tiny one alone (the exact path)
            with_tiny = store.search_rows(queries[0], 10, [parts[held[0]], tiny])
            assert with_tiny == store.search(queries[0], 10, np.concatenate([ids[token == held[0]], ids[:5]]))
        assert store.search_rows(queries[0], 10, [tiny]) == store.search(queries[0], 10, ids[:5])
        assert store.search_rows(queries[0], 10, []) == []


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: make_vector_index("faiss-hnsw", DIM),
                                  lambda: make_vector_index("faiss-ivf", DIM),
                                  lambda: GpuIvfIndex(DIM, SelectorlessCpu(), min_rows=1)],
                         ids=["hnsw", "ivf", "gpu-ivf"])
def test_a_stale_set_never_admits_a_row(make, data):
    """Sets made before a removal, a replacement and a compaction (labels renumbered) are remade:
    the answers equal the reference store's over the ids still allowed, never a removed row."""
    ids, vecs, queries, token = data
    store, ref = make(), MemoryIndex(DIM)
    store.add(ids, vecs)
    ref.add(ids, vecs)
    readable = ids[token < 4]
    stale = [store.rows_for(ids[token == t]) for t in range(4)]
    gone = readable[: len(readable) // 2]
    store.remove(gone)  # past half the rows: compacts, so every label is renumbered
    ref.remove(gone)
    replaced = readable[-50:]
    new_vecs = _unit(np.random.default_rng(9), 50)
    store.add(replaced, new_vecs)
    ref.add(replaced, new_vecs)
    assert all(p.generation != store.generation for p in stale)
    stale_union = union(stale, stale[0].generation, stale[0].n)  # as the collection caches it
    for q in queries:
        want = ref.search(q, 10, readable)
        assert store.search_rows(q, 10, stale, exact=True) == want
        assert store.search_rows(q, 10, [stale_union], exact=True) == want
        for given in (stale, [stale_union]):
            approx = store.search_rows(q, 10, given)
            assert len(approx) == 10 and not {i for i, _ in approx} & set(gone.tolist())
            assert {i for i, _ in approx} <= set(readable.tolist())


def test_a_reloaded_index_does_not_take_another_instances_sets(data, tmp_path):
    ids, vecs, queries, token = data
    store = make_vector_index("faiss-ivf", DIM)
    store.add(ids[:3000], vecs[:3000])
    old = store.rows_for(ids[:3000][token[:3000] == 0])
    store.save(tmp_path / "x.ivf")
    other = load_vector_index("faiss-ivf", tmp_path / "x.ivf", DIM)
    other.remove(ids[:10])
    assert old.generation != other.generation
    got = other.search_rows(queries[0], 3000, [old], exact=True)
    assert {i for i, _ in got} == set(ids[10:3000][token[10:3000] == 0].tolist())


# -- through the embedded collection -----------------------------------------------------------

def _doc(key: str) -> Document:
    return Document(key=key, source=f"/src/{key}", text=key, content_hash=f"h-{key}", acl=None, title=key)


def _chunks(key: str, n: int) -> list[Chunk]:
    return [Chunk(document_key=key, index=i, text=f"{key} {i}", num_tokens=2) for i in range(n)]


@pytest.fixture
def ivf_collection(tmp_path):
    """Ten groups of 300 one-vector documents in a trained IVF collection, group g9 held by nobody below."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("docs", "test-embedder", "fp1", DIM, {"max_tokens": 100})
    coll = EmbeddedCollection(catalog, info, tmp_path / "index", "faiss-ivf", exact_below=0)
    rng = np.random.default_rng(4)
    coll.batch_writes = True
    for i in range(3000):
        coll.replace_document(_doc(f"d{i}"), frozenset({f"group:g{i % 10}"}), _chunks(f"d{i}", 1), _unit(rng, 1))
    coll.flush()
    yield coll, catalog
    catalog.close()


def _keys(coll: EmbeddedCollection, hits) -> set[str]:
    return {r.document_key for r in coll.chunk_records([i for i, _ in hits]).values()}


def _groups(coll, hits) -> set[str]:
    return {f"g{int(k[1:]) % 10}" for k in _keys(coll, hits)}


def test_the_collection_caches_rows_per_token_and_follows_acl_changes(ivf_collection):
    coll, _ = ivf_collection
    q = _unit(np.random.default_rng(5), 1)[0]
    alice = store_filter(Principal("alice", frozenset({"g1", "g2"})))
    assert _groups(coll, coll.search(q, 50, alice)) == {"g1", "g2"}
    assert coll.vectors.num_approximate_searches == 1  # exact_below=0: the lists, with the union's bitmap
    cached, unions = dict(coll._rows_cache), dict(coll._union_cache)
    assert {"group:g1", "group:g2"} <= cached.keys() and tuple(sorted(alice)) in unions
    coll.search(q, 50, alice)
    assert all(coll._rows_cache[t] is cached[t] for t in cached)  # made once, reused
    assert all(coll._union_cache[t] is unions[t] for t in unions)
    # An ACL change without re-embedding: g1's documents go to g9; alice must lose them at once.
    for i in range(1, 3000, 10):
        coll.set_acl(f"d{i}", frozenset({"group:g9"}))
    hits = coll.search(q, 3000, alice)
    assert _groups(coll, hits) == {"g2"} and len(hits) == 300
    # A removal changes the index's rows: the next search remakes the sets, the removed row is gone.
    first_g2 = sorted(_keys(coll, hits))[0]
    coll.delete_document(first_g2)
    hits = coll.search(q, 3000, alice)
    assert len(hits) == 299 and first_g2 not in _keys(coll, hits)


def test_a_tiny_cache_budget_changes_nothing_but_time(ivf_collection, monkeypatch):
    coll, _ = ivf_collection
    monkeypatch.setattr(collection_module, "_CACHE_BYTES", 1)
    q = _unit(np.random.default_rng(6), 1)[0]
    for held in ({"g0"}, {"g3", "g4"}, {"g0", "g3", "g4", "g5"}, {"g8"}):
        tokens = store_filter(Principal("bob", frozenset(held)))
        hits = coll.search(q, 3000, tokens)
        assert _groups(coll, hits) == held and len(hits) == 300 * len(held)
    assert sum(1 for r in coll._rows_cache.values() if r.count) <= 1  # each new token dropped the rest
