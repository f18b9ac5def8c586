"""Which path HNSW / IVF search takes (exact, approximate, fallback), and no leaks through any."""

from __future__ import annotations

import numpy as np
import pytest

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.vectors import load_vector_index, make_vector_index
from retrieval.vectors.faiss_ann import EXACT_BELOW, HnswIndex, IvfIndex
from retrieval.vectors.memory import MemoryIndex

DIM = 16
ANN_KINDS = ["faiss-hnsw", "faiss-ivf"]
USERS = [f"u{i}" for i in range(8)]
GROUPS = [f"g{i}" for i in range(6)]


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_default_threshold_is_unchanged():
    assert EXACT_BELOW == 16384
    for kind in ANN_KINDS:
        assert make_vector_index(kind, DIM).exact_below == EXACT_BELOW
    assert HnswIndex(DIM).exact_below == IvfIndex(DIM).exact_below == EXACT_BELOW
    with pytest.raises(ValueError, match="exact_below"):
        HnswIndex(DIM, exact_below=-1)


@pytest.mark.parametrize("kind", ANN_KINDS)
def test_selective_allow_list_is_searched_exactly_broad_one_through_the_index(kind, tmp_path):
    rng = np.random.default_rng(0)
    ids = np.arange(2000, dtype=np.int64)
    vecs = _unit(rng, len(ids))
    store, ref = make_vector_index(kind, DIM, exact_below=100), MemoryIndex(DIM)
    store.add(ids, vecs)
    ref.add(ids, vecs)
    q = _unit(rng, 1)[0]
    selective = np.sort(rng.choice(ids, size=100, replace=False))
    assert store.search(q, 10, selective) == ref.search(q, 10, selective)
    assert (store.num_exact_searches, store.num_approximate_searches) == (1, 0)
    broad = np.sort(rng.choice(ids, size=101, replace=False))
    got = store.search(q, 10, broad)
    assert len(got) == 10 and {i for i, _ in got} <= set(broad.tolist())
    assert (store.num_exact_searches, store.num_approximate_searches) == (1, 1)
    # The threshold is a setting of the store, not of the file: loading takes it again.
    store.save(tmp_path / "x")
    loaded = load_vector_index(kind, tmp_path / "x", DIM, exact_below=0)
    assert loaded.exact_below == 0
    loaded.search(q, 10, selective)
    assert (loaded.num_exact_searches, loaded.num_approximate_searches) == (0, 1)
    assert load_vector_index(kind, tmp_path / "x", DIM).exact_below == EXACT_BELOW


@pytest.mark.parametrize("kind", ANN_KINDS)
def test_fallback_to_exact_when_the_index_finds_fewer_than_k(kind, monkeypatch):
    rng = np.random.default_rng(1)
    ids = np.arange(1500, dtype=np.int64)
    vecs = _unit(rng, len(ids))
    store, ref = make_vector_index(kind, DIM, exact_below=0), MemoryIndex(DIM)
    store.add(ids, vecs)
    ref.add(ids, vecs)
    q, allowed = _unit(rng, 1)[0], ids[::3]
    assert len(store.search(q, 10, allowed)) == 10
    assert (store.num_approximate_searches, store.num_fallbacks) == (1, 0)
    # A graph walk / probe that digs up too few allowed rows (a very selective filter):
    # the exact path answers, so the principal still gets k hits, and the exact ones.
    ann_search = store._ann_search
    monkeypatch.setattr(store, "_ann_search", lambda *a, **kw: ann_search(*a, **kw)[:3])
    assert store.search(q, 10, allowed) == ref.search(q, 10, allowed)
    assert (store.num_approximate_searches, store.num_fallbacks, store.num_exact_searches) == (2, 1, 0)


def _write(index: EmbeddedCollection, key: str, acl: frozenset[str], vectors: np.ndarray) -> None:
    body = f"document {key}"
    doc = Document(key=key, source=f"/lab/{key}", text=body, content_hash=f"h-{key}", acl=acl, title=key)
    chunks = [Chunk(document_key=key, index=i, text=f"{key} part {i}", num_tokens=3)
              for i in range(len(vectors))]
    index.replace_document(doc, acl, chunks, vectors)


def _random_acl(rng: np.random.Generator) -> frozenset[str]:
    if rng.random() < 0.03:
        return frozenset({"public"})
    entries = [f"user:{u}" for u in USERS] + [f"group:{g}" for g in GROUPS]
    return frozenset(rng.choice(entries, size=int(rng.integers(1, 3)), replace=False).tolist())


def _random_principal(rng: np.random.Generator) -> Principal:
    groups = rng.choice(GROUPS, size=int(rng.integers(0, 3)), replace=False).tolist()
    return Principal(str(rng.choice(USERS)), frozenset(groups))


@pytest.mark.parametrize("kind", ANN_KINDS)
def test_no_leak_through_the_approximate_paths(kind, tmp_path):
    """Many chunks under several ACLs, threshold 0: every hit is readable, before and after compaction."""
    rng = np.random.default_rng(2)
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("lab", "test-embedder", "fp-1", DIM, {"max_tokens": 64})
    index = EmbeddedCollection(catalog, info, tmp_path / "indexes", kind, exact_below=0)
    acls: dict[str, frozenset[str]] = {}
    vectors: dict[str, np.ndarray] = {}
    for d in range(120):  # 3000 chunks: IVF trains
        key = f"doc{d:03d}"
        acls[key], vectors[key] = _random_acl(rng), _unit(rng, 25)
        _write(index, key, acls[key], vectors[key])

    def check(queries: int) -> int:
        searches = 0
        for _ in range(queries):
            principal = _random_principal(rng)
            tokens = store_filter(principal)
            # Half the queries aim straight at a chunk this principal may not read.
            forbidden = [k for k, acl in acls.items() if not principal.can_read(acl)]
            if forbidden and rng.random() < 0.5:
                q = vectors[str(rng.choice(forbidden))][int(rng.integers(25))]
            else:
                q = _unit(rng, 1)[0]
            readable = sum(25 for acl in acls.values() if principal.can_read(acl))
            k = int(rng.integers(1, 30))
            hits = index.search(q, k, sorted(tokens))
            searches += 1
            assert len(hits) == min(k, readable)
            records = index.chunk_records([i for i, _ in hits])
            for i, _ in hits:
                assert principal.can_read(acls[records[i].document_key]), (principal, records[i].document_key)
                assert principal.can_read(records[i].acl)
        return searches

    searches = check(60)
    store = index.vectors
    assert (store.num_approximate_searches, store.num_exact_searches) == (searches, 0)
    # Deletes that compact the index (more dead rows than live ones; IVF re-trains on 1300),
    # then ACL changes that move chunks between principals without touching vectors.
    for d in range(68):
        index.delete_document(f"doc{d:03d}")
        del acls[f"doc{d:03d}"], vectors[f"doc{d:03d}"]
    for key in list(acls)[:20]:
        acls[key] = _random_acl(rng)
        index.set_acl(key, acls[key])
    assert index.stats()["chunks"] == 52 * 25
    searches += check(60)
    store = index.vectors
    assert (store.num_approximate_searches, store.num_exact_searches) == (searches, 0)
    assert store.index.ntotal == store.count() == 52 * 25  # compacted (HNSW cannot delete otherwise)
    assert not isinstance(store, IvfIndex) or store.index.is_trained
    catalog.close()


@pytest.mark.parametrize("kind", ANN_KINDS)
@pytest.mark.parametrize("ids", [np.arange(2**63 - 1500, 2**63 - 1, dtype=np.int64),  # consecutive: looked up by offset
                                 np.arange(-(2**63), -(2**63) + 3000, 2, dtype=np.int64),
                                 np.random.default_rng(3).choice(2**62, 1499, replace=False) - 2**61])  # scattered
def test_allow_list_translation_at_the_ends_of_int64(kind, ids):
    """Allowed ids below, above and between the stored ones, at int64's extremes, repeated: only the
    stored allowed ones come back, exact path and lists alike."""
    rng = np.random.default_rng(4)
    vecs = _unit(rng, len(ids))
    store, ref = make_vector_index(kind, DIM, exact_below=0), MemoryIndex(DIM)
    for s in (store, ref):
        s.add(ids, vecs)
        s.remove(ids[:7])
    extremes = np.array([-(2**63), 2**63 - 1, 0, -1, max(int(ids.min()) - 1, -(2**63)),
                         min(int(ids.max()) + 1, 2**63 - 1)], dtype=np.int64)
    for allowed in (ids[::3], ids, np.concatenate([extremes, ids[1::5], ids[1::5]]), extremes, ids[:7]):
        q = _unit(rng, 1)[0]
        want = ref.search(q, 10, np.unique(allowed))  # the reference returns a repeated id twice
        exact = store.search(q, 10, allowed, exact=True)
        assert [i for i, _ in exact] == [i for i, _ in want]
        assert np.allclose([s for _, s in exact], [s for _, s in want], atol=1e-5)
        got = store.search(q, 10, allowed)
        assert len(got) == len(want) and {i for i, _ in got} <= set(allowed.tolist()) - set(ids[:7].tolist())
