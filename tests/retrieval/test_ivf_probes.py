"""The IVF probe table (retrieval/vectors/ivf_probes.py): measured at training, it reaches its recall
on queries it was not calibrated on, under filters of several fractions; it adapts to how clustered
the data are; it survives save/load, and a file written before it still loads and searches."""

from __future__ import annotations

import math

import faiss
import numpy as np
import pytest

from retrieval.vectors import ivf_probes, load_vector_index
from retrieval.vectors.faiss_ann import IvfIndex
from retrieval.vectors.ivf_probes import FRACTIONS, ProbeTable, list_ranks, lists_of, probes_needed

DIM = 32
N = 20_000  # 141 lists


def _normed(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def _data(kind: str, n: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows and fresh queries (not stored rows): clustered round 200 topics (cosine ~0.7), or isotropic."""
    rng = np.random.default_rng(seed)
    if kind == "isotropic":
        return _normed(rng.standard_normal((n, DIM))), _normed(rng.standard_normal((queries, DIM)))
    topics = _normed(rng.standard_normal((200, DIM)))

    def draw(m: int) -> np.ndarray:
        return _normed(topics[rng.integers(0, len(topics), m)] + rng.standard_normal((m, DIM)) / math.sqrt(DIM))

    return draw(n), draw(queries)


@pytest.fixture(scope="module", params=["clustered", "isotropic"])
def built(request):
    vecs, queries = _data(request.param, N, 60)
    ids = np.arange(100, 100 + N, dtype=np.int64)
    store = IvfIndex(DIM, nprobe=1, exact_below=0)  # nprobe 1: the table decides
    store.add(ids, vecs)
    return request.param, ids, queries, store, vecs


def _exact(vecs: np.ndarray, ids: np.ndarray, q: np.ndarray, allowed: np.ndarray, k: int = 10) -> set[int]:
    rows = np.searchsorted(ids, allowed)
    return set(allowed[np.argsort(-(vecs[rows] @ q), kind="stable")[:k]].tolist())


@pytest.mark.parametrize("k", [10, 30])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3, 0.1, 0.05, 0.01])
def test_calibrated_nprobe_reaches_the_recall_goal_under_a_filter(built, fraction, k):
    """Recall@k against exact filtered search >= 0.95 (the goal; the table aims at 0.97 for k = 10
    on its own queries; a deeper k is looked up as a stricter filter), all k hits readable, and
    answered by the lists, not the exact fallback."""
    _, ids, queries, store, vecs = built
    rng = np.random.default_rng(int(fraction * 1000))
    allowed = np.sort(rng.choice(ids, size=int(fraction * N), replace=False))
    readable = set(allowed.tolist())
    before = (store.num_approximate_searches, store.num_fallbacks)
    found = 0
    for q in queries:
        got = store.search(q, k, allowed)
        assert len(got) == k and {i for i, _ in got} <= readable
        found += len({i for i, _ in got} & _exact(vecs, ids, q, allowed, k))
    assert found / (k * len(queries)) >= 0.95
    assert store.num_approximate_searches - before[0] == len(queries)
    assert store.num_fallbacks == before[1]


def test_the_table_follows_the_data(built):
    """Broad filters probe far fewer than the old third of the lists where the data cluster, more where
    they do not; stricter filters never probe fewer; the configured nprobe is a floor."""
    kind, _, _, store, _ = built
    table, nlist = store.probes, store.index.nlist
    assert table is not None and table.fractions == FRACTIONS[:len(table.fractions)]
    assert table.fractions[-1] * N <= 1000 < table.fractions[-2] * N  # down to MIN_ROWS readable rows
    assert list(table.nprobes) == sorted(table.nprobes) and all(r >= table.target for r in table.recalls)
    probes = [store._nprobe(1 / f) for f in (1.0, 0.5, 0.1, 0.01, 0.001)]
    assert probes == sorted(probes) and probes[-1] <= nlist
    if kind == "clustered":
        assert probes[0] < nlist // 3
    floor = IvfIndex(DIM, nprobe=nlist // 2)
    floor.index, floor.probes = store.index, table
    assert floor._nprobe(1.0) == max(nlist // 2, table.nprobes[0])


def test_a_harder_corpus_gets_more_probes():
    clustered, _ = _data("clustered", 5000, 1, seed=3)
    isotropic, _ = _data("isotropic", 5000, 1, seed=3)
    widths = []
    for vecs in (clustered, isotropic):
        store = IvfIndex(DIM, nprobe=1, exact_below=0)
        store.add(np.arange(len(vecs)), vecs)
        widths.append(store.probes.nprobes[0])
    assert widths[0] < widths[1]


@pytest.mark.parametrize("fraction", [1.0, 0.2, 0.05])
def test_counted_recall_is_what_filtered_searches_find(built, fraction):
    """The table counts recall from list ranks instead of searching; real Faiss searches with the
    selector, at several nprobe, find exactly the true neighbours it counts as found."""
    _, ids, queries, store, vecs = built
    rng = np.random.default_rng(5)
    labels = np.sort(rng.choice(N, size=int(fraction * N), replace=False))
    truth = np.array([labels[np.argsort(-(vecs[labels] @ q), kind="stable")[:10]] for q in queries])
    need = probes_needed(list_ranks(store.index, queries), lists_of(store.index, N), truth)
    for nprobe in (1, 3, 10, 30, store.index.nlist):
        params = faiss.SearchParametersIVF(nprobe=nprobe, sel=store._selector(store.rows_for(store._ext[labels])))
        _, found = store.index.search(queries, 10, params=params)
        hit = (truth[:, :, None] == found[:, None, :]).any(axis=2)  # (queries, k): each true neighbour found?
        assert np.array_equal(hit, need <= nprobe), nprobe


def test_calibration_truth_is_exact_search_over_each_nested_allow_list(monkeypatch):
    """The one-pass truth (chunks, thresholds, tiers) equals brute force per allow-list, own row left out."""
    monkeypatch.setattr(ivf_probes, "CHUNK", 5000)  # several chunks after the first
    rng = np.random.default_rng(9)
    vecs, _ = _data("isotropic", 30_000, 1, seed=9)
    labels = np.sort(rng.choice(40_000, size=30_000, replace=False))  # not every row: the gather path
    rows = np.zeros((40_000, DIM), dtype=np.float32)
    rows[labels] = vecs
    source = rng.choice(labels, size=25, replace=False)
    queries = rows[source] + 0.1 * _normed(rng.standard_normal((25, DIM)))
    counts = [300, 3000, 30_000]
    tier = np.searchsorted(counts, rng.permutation(30_000), side="right")
    truth = ivf_probes._exact_truth(queries, source, rows, labels, tier, 3, 10)
    for j in range(3):
        allowed = labels[tier <= j]
        for i, q in enumerate(queries):
            scores = rows[allowed] @ q
            scores[allowed == source[i]] = -np.inf
            assert set(truth[j][i].tolist()) == set(allowed[np.argsort(-scores)[:10]].tolist()), (j, i)


def test_lookup_takes_the_next_stricter_fraction_and_extrapolates_below():
    table = ProbeTable((1.0, 0.5, 0.1), (4, 6, 20), (0.98, 0.97, 0.97), 10, 0.97, 0.1)
    assert [table.nprobe_for(f) for f in (1.0, 0.7, 0.5, 0.2, 0.1)] == [4, 6, 6, 20, 20]
    assert table.nprobe_for(0.05) == 40 and table.nprobe_for(0.01) == 200


def test_the_table_survives_save_and_load(built, tmp_path):
    _, ids, queries, store, _ = built
    store.save(tmp_path / "x.ivf")
    loaded = load_vector_index("faiss-ivf", tmp_path / "x.ivf", DIM, exact_below=0)
    assert loaded.probes == store.probes
    loaded.nprobe = store.nprobe  # the floor is a setting of the store, not part of the file
    assert [loaded._nprobe(w) for w in (1.0, 3.0, 50.0, 5000.0)] == [store._nprobe(w) for w in (1.0, 3.0, 50.0, 5000.0)]
    allowed = ids[::4]
    for q in queries[:5]:
        assert loaded.search(q, 10, allowed) == store.search(q, 10, allowed)


def test_a_file_from_before_the_table_loads_and_searches_with_the_old_rule(built, tmp_path):
    _, ids, queries, store, _ = built
    store.save(tmp_path / "new.ivf")
    with np.load(tmp_path / "new.ivf") as data:
        old = {name: data[name] for name in data.files if not name.startswith("probe_")}
    with open(tmp_path / "old.ivf", "wb") as f:
        np.savez(f, **old)  # the arrays an index file held before the table existed
    loaded = load_vector_index("faiss-ivf", tmp_path / "old.ivf", DIM, exact_below=0)
    nlist = loaded.index.nlist
    assert loaded.probes is None
    assert loaded._nprobe(1.0) == max(32, nlist // 3) and loaded._nprobe(4.0) == min(nlist, 2 * max(32, nlist // 3))
    allowed = np.sort(ids[::7])
    got = loaded.search(queries[0], 10, allowed)
    assert len(got) == 10 and {i for i, _ in got} <= set(allowed.tolist())
    assert loaded.search(queries[0], 10, np.empty(0, dtype=np.int64)) == []  # fail closed
    # the next training (here: a compaction after removals) measures a table again
    loaded.remove(ids[: N // 2 + 1100])
    assert loaded.probes is not None and loaded.index.ntotal == loaded.count()
    got = loaded.search(queries[0], 10, allowed)
    assert len(got) == 10 and {i for i, _ in got} <= set(allowed[allowed >= ids[N // 2 + 1100]].tolist())


@pytest.mark.parametrize("ids_kind", ["consecutive", "scattered"])
def test_acl_invariants_hold_with_the_calibrated_policy(ids_kind):
    """Whatever the table picks: never an id outside the allow-list (also when it names removed or
    unknown ids), k hits whenever k are readable (the exact fallback covers a filter that empties the
    probed lists), nothing for an empty allow-list."""
    rng = np.random.default_rng(11)
    vecs, queries = _data("clustered", 6000, 40, seed=11)
    ids = (np.arange(500, 6500) if ids_kind == "consecutive"
           else np.sort(rng.choice(10**12, size=6000, replace=False))).astype(np.int64)
    store = IvfIndex(DIM, nprobe=1, exact_below=0)
    store.add(ids, vecs)
    removed = ids[rng.choice(len(ids), size=400, replace=False)]
    store.remove(removed)
    live = np.setdiff1d(ids, removed)
    strangers = np.array([-5, 0, 499, 6500, 10**13], dtype=np.int64)
    for trial, q in enumerate(queries):
        k = int(rng.integers(1, 30))
        if trial % 4 == 0:  # readable rows all far from the query: its nearest 800 are unreadable
            scores = vecs @ q
            near = set(ids[np.argsort(-scores)[:800]].tolist())
            allowed = np.array([i for i in live.tolist() if i not in near], dtype=np.int64)
        else:
            allowed = rng.choice(live, size=int(rng.integers(1, len(live))), replace=False)
        asked = np.concatenate([allowed, removed[:50], strangers, allowed[:20]])  # also repeats
        got = store.search(q, k, asked)
        assert {i for i, _ in got} <= set(allowed.tolist()), trial
        assert len(got) == min(k, len(allowed)), trial
        assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)
    assert store.search(queries[0], 10, np.empty(0, dtype=np.int64)) == []
    assert store.search(queries[0], 10, removed) == []
    assert store.num_approximate_searches == len(queries) and store.num_exact_searches == 0
