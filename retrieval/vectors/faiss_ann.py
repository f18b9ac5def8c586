"""Approximate Faiss vector indexes (HNSW, IVF) that keep the ACL filter inside the search.

Both keep their own copy of the vectors under dense internal labels (row numbers), with the
external chunk ids beside them. That buys three things Faiss alone does not give:

- removal and replacement on HNSW (which cannot delete): a replaced or removed row is marked
  dead, never allowed again, and the index is rebuilt once dead rows outnumber live ones;
- IVF training that follows the collection: the index is re-trained when the collection has
  grown well past the size it was trained on;
- an exact path. A selective allow-list (at most `exact_below` allowed rows) is searched
  exhaustively over just those rows, which is both faster and exact; a broad one goes to the
  graph / lists with the allow-list as an ID selector and a search width scaled by how
  selective it is. If the approximate search still returns fewer hits than it could, the
  exact path answers instead, so a principal who may read at least k chunks always gets k hits.

Counters say which path answered: `num_exact_searches` (exact without consulting the index),
`num_approximate_searches` (the graph / lists were searched) and `num_fallbacks` (of those,
the ones that found fewer than k and were answered exactly instead).
"""

from __future__ import annotations

import math
import os
import time
import zipfile
from pathlib import Path

import faiss
import numpy as np

from rag.errors import StoreError
from rag.private_files import open_private
from retrieval.vectors.ivf_probes import MIN_ROWS, ProbeTable, calibrate
from retrieval.vectors.memory import _check
from retrieval.vectors.row_sets import RowSet, next_generation, union

# At or below this many allowed rows, exhaustive search over just those rows is exact and
# costs about what a graph search of the width a filter this selective needs (a few ms).
EXACT_BELOW = 16384


class _AnnIndex:
    """Shared bookkeeping: labels, dead rows, allow-list translation, exact fallback."""

    kind = "ann"

    def __init__(self, dim: int, exact_below: int = EXACT_BELOW) -> None:
        if exact_below < 0:
            raise ValueError(f"exact_below must be >= 0 (0: always search the index), got {exact_below}")
        self.dim = dim
        self.exact_below = exact_below
        self.num_exact_searches = 0  # answered exactly without the index (asked, selective, or no index)
        self.num_approximate_searches = 0  # the graph / inverted lists were searched
        self.num_fallbacks = 0  # approximate searches that found < k and ran exactly instead
        # Row tables in buffers that grow by doubling (rows [0, _n) are used): ingest adds one
        # document at a time, and re-concatenating would copy the whole matrix on every add.
        self._n = 0
        self._vbuf = np.empty((0, dim), dtype=np.float32)
        self._ebuf = np.empty(0, dtype=np.int64)  # label -> external id
        self._lbuf = np.empty(0, dtype=bool)  # label -> still live
        self._label_of: dict[int, int] = {}
        # (live ext ids sorted, their labels, and where the ids are dense: (first id, label by id - first id, -1 none))
        self._sorted: tuple[np.ndarray, np.ndarray, tuple[np.int64, np.ndarray] | None] | None = None
        # Which rows are live and what their labels mean: a RowSet of another generation is remade.
        self.generation = next_generation()
        self.index = self._new_index(0)

    @property
    def _vecs(self) -> np.ndarray:
        return self._vbuf[:self._n]

    @_vecs.setter
    def _vecs(self, rows: np.ndarray) -> None:
        self._vbuf = np.ascontiguousarray(rows, dtype=np.float32)
        self._n = len(rows)

    @property
    def _ext(self) -> np.ndarray:
        return self._ebuf[:self._n]

    @_ext.setter
    def _ext(self, ids: np.ndarray) -> None:
        self._ebuf = np.asarray(ids, dtype=np.int64)

    @property
    def _live(self) -> np.ndarray:
        return self._lbuf[:self._n]

    @_live.setter
    def _live(self, live: np.ndarray) -> None:
        self._lbuf = np.asarray(live, dtype=bool)

    def _grow(self, extra: int) -> None:
        need = self._n + extra
        if need <= len(self._vbuf):
            return
        cap = max(need, 2 * len(self._vbuf), 1024)
        for name in ("_vbuf", "_ebuf", "_lbuf"):
            old = getattr(self, name)
            new = np.empty((cap, *old.shape[1:]), dtype=old.dtype)
            new[:self._n] = old[:self._n]
            setattr(self, name, new)

    # -- subclass hooks --------------------------------------------------------------------

    def _new_index(self, n: int) -> faiss.Index:
        raise NotImplementedError

    def _train_and_fill(self) -> None:
        """(Re)build the index over all live rows (labels renumbered first)."""
        raise NotImplementedError

    def _ann_search(self, query: np.ndarray, k: int, rows: RowSet, widen: float
                    ) -> list[tuple[int, float]]:
        raise NotImplementedError

    def _has_index(self) -> bool:
        """Whether the approximate index can answer (IVF: only once trained)."""
        return True

    def _extra_arrays(self) -> dict[str, np.ndarray]:
        """Arrays a kind keeps in its file beside the index and the label tables."""
        return {}

    def _read_extra_arrays(self, data) -> None:
        """Read back what `_extra_arrays` wrote (absent from files of older versions)."""

    # -- VectorIndex -----------------------------------------------------------------------

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = _check(vectors, self.dim)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) != len(vectors):
            raise StoreError(f"{len(ids)} ids for {len(vectors)} vectors")
        if len(ids) == 0:
            return
        # A repeated id within one call: the last vector wins, as in the reference store. Ids in
        # strictly ascending order (a bulk load of catalog ids) repeat none: no sort, no gathered copy.
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            _, last = np.unique(ids[::-1], return_index=True)
            keep = np.sort(len(ids) - 1 - last)
            ids, vectors = ids[keep], vectors[keep]
        self.remove(ids)
        start, m = self._n, len(ids)
        labels = np.arange(start, start + m, dtype=np.int64)
        self._grow(m)
        self._vbuf[start:start + m] = vectors
        self._ebuf[start:start + m] = ids
        self._lbuf[start:start + m] = True
        self._n += m
        self._label_of.update(zip(ids.tolist(), labels.tolist(), strict=True))
        self._rows_changed()
        self._after_add(labels, self._vbuf[start:start + m])  # our contiguous float32 copy of `vectors`

    def remove(self, ids: np.ndarray) -> None:
        if not self._label_of:
            return  # nothing live (a first bulk add): no per-id lookups
        dead = [self._label_of.pop(int(i)) for i in np.asarray(ids, dtype=np.int64) if int(i) in self._label_of]
        if not dead:
            return
        self._live[dead] = False
        self._rows_changed()
        num_dead = len(self._live) - len(self._label_of)
        if num_dead > max(1024, len(self._label_of)):
            self._compact()

    def count(self) -> int:
        return len(self._label_of)

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray, exact: bool = False
               ) -> list[tuple[int, float]]:
        return self.search_rows(query, k, [self.rows_for(allowed)], exact)

    def search_rows(self, query: np.ndarray, k: int, parts: list[RowSet], exact: bool = False
                    ) -> list[tuple[int, float]]:
        """`search` over the union of row sets made by `rows_for` (one per ACL token, kept by the
        caller across queries, or their union); a set of an older generation is remade first."""
        query = _check(query.reshape(1, -1), self.dim)
        parts = [self._current(p) for p in parts]
        rows = union(parts, self.generation, self._n) if parts else None
        if rows is None or rows.count == 0 or k <= 0:
            return []  # an empty allow-list must never mean "no filter"
        want = min(k, rows.count)
        if exact or rows.count <= self.exact_below or not self._has_index():
            self.num_exact_searches += 1
            return self._exact(query[0], want, rows.sorted_labels())
        self._sync()
        self.num_approximate_searches += 1
        hits = self._ann_search(query, want, rows, widen=len(self._label_of) / rows.count)
        if len(hits) < want:
            self.num_fallbacks += 1
            return self._exact(query[0], want, rows.sorted_labels())
        return hits

    # -- persistence -----------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """One file holding the index and the label tables; written atomically."""
        self._sync()
        tmp = path.with_suffix(path.suffix + ".tmp")
        # faiss.serialize_index's bytes, without its copy into a fresh array: the array views the
        # writer's buffer (kept alive until written), reserved up front so it never regrows.
        writer = faiss.VectorIOWriter()
        writer.data.resize(self._serialized_size_hint())
        writer.data.resize(0)  # a std::vector keeps its capacity
        faiss.write_index(self.index, writer)
        size = writer.data.size()
        index_bytes = faiss.rev_swig_ptr(writer.data.data(), size) if size else np.empty(0, dtype=np.uint8)
        with open_private(tmp, "wb") as f:
            np.savez(f, kind=np.array(self.kind), index=index_bytes,
                     vecs=self._vecs, ext=self._ext, live=self._live, **self._extra_arrays())
        del index_bytes, writer
        os.replace(tmp, path)

    def _serialized_size_hint(self) -> int:
        """About how many bytes the Faiss index serializes to (a reservation; 0: let it grow)."""
        return 0

    @classmethod
    def load(cls, path: Path, dim: int, exact_below: int = EXACT_BELOW) -> _AnnIndex:
        try:
            # Members are read from the file as needed (not the whole file into memory first), the
            # index streamed from its member straight into Faiss (no array, no vector copy of it).
            with open(path, "rb") as f, np.load(f) as data:
                if str(data["kind"]) != cls.kind:
                    raise StoreError(f"{path} holds a {data['kind']} index, not {cls.kind}")
                store = cls(dim, exact_below=exact_below)
                store.index = _read_index_member(data.zip, "index.npy")
                store._vecs = data["vecs"].astype(np.float32, copy=False)
                store._ext = data["ext"].astype(np.int64, copy=False)
                store._live = data["live"].astype(bool, copy=False)
                store._read_extra_arrays(data)
        except (OSError, ValueError, KeyError, RuntimeError, EOFError, zipfile.BadZipFile) as e:
            raise StoreError(f"cannot read Faiss index {path}: {e}") from e
        if store._vecs.shape[1:] != (dim,) or store.index.d != dim:
            raise StoreError(f"{path} holds {store._vecs.shape[1]}-dim vectors, expected {dim}")
        live = np.flatnonzero(store._live)
        store._label_of = dict(zip(store._ext[live].tolist(), live.tolist(), strict=True))
        return store

    # -- internals -------------------------------------------------------------------------

    def _after_add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        pass  # rows reach the index in _sync, in one batch

    def sync(self) -> None:
        """Bring the index up to date now (otherwise the next search or save does it)."""
        self._sync()

    def _sync(self) -> None:
        """Insert rows added since the last sync: one big add is parallel, many small ones are not."""
        start = self.index.ntotal
        if start < len(self._vecs):
            self.index.add(self._vecs[start:])

    def _current(self, rows: RowSet) -> RowSet:
        """`rows` if of this generation, else remade: from its ids, or a union from its parts."""
        if rows.generation == self.generation:
            return rows
        if rows.parts:
            return union([self._current(p) for p in rows.parts], self.generation, self._n)
        return self.rows_for(rows.ids)

    def _rows_changed(self) -> None:
        self._sorted = None
        self.generation = next_generation()

    def rows_for(self, allowed: np.ndarray) -> RowSet:
        """The live rows of the allowed external ids (unknown ids ignored), for this generation."""
        allowed = np.asarray(allowed, dtype=np.int64)
        return RowSet.of_labels(allowed, self.generation, self._n, self._labels_of(allowed))

    def _labels_of(self, allowed: np.ndarray) -> np.ndarray:
        """Live labels of the allowed external ids, in no order, repeated where an id is."""
        if self._sorted is None:
            live = np.flatnonzero(self._live)
            order = np.argsort(self._ext[live], kind="stable")
            ext_sorted, labels = self._ext[live][order], live[order]
            dense = None
            # Catalog ids are mostly consecutive: a table indexed by id answers a broad allow-list
            # in one gather, where a binary search per id took 10 ms for 500,000 of 1M ids.
            if len(ext_sorted) and int(ext_sorted[-1]) - int(ext_sorted[0]) < 4 * len(ext_sorted):
                by_offset = np.full(int(ext_sorted[-1]) - int(ext_sorted[0]) + 1, -1, dtype=np.int64)
                by_offset[ext_sorted - ext_sorted[0]] = labels
                dense = (ext_sorted[0], by_offset)
            self._sorted = (ext_sorted, labels, dense)
        ext_sorted, labels, dense = self._sorted
        if len(ext_sorted) == 0 or len(allowed) == 0:
            return np.empty(0, dtype=np.int64)
        if dense is not None:
            first, by_offset = dense
            inside = allowed[(allowed >= first) & (allowed <= first + (len(by_offset) - 1))]  # no overflow below
            found = by_offset[inside - first]
            return found[found >= 0]
        pos = np.searchsorted(ext_sorted, allowed)
        pos = np.clip(pos, 0, len(ext_sorted) - 1)
        return labels[pos[ext_sorted[pos] == allowed]]

    def _selector(self, rows: RowSet) -> faiss.IDSelector:
        """A bitmap over labels (the set's own when dense), where IDSelectorBatch hashes each id."""
        bits = rows.packed()  # Faiss reads bit (i & 7) of byte i >> 3
        selector = faiss.IDSelectorBitmap(rows.n, faiss.swig_ptr(bits))
        selector.keep_alive = bits  # the selector points into this buffer
        return selector

    def _exact(self, query: np.ndarray, k: int, labels: np.ndarray) -> list[tuple[int, float]]:
        scores = self._vecs[labels] @ query
        ids = self._ext[labels]
        top = np.lexsort((ids, -scores))[:k]  # best score first, ties by smaller id
        return [(int(ids[j]), float(scores[j])) for j in top]

    def _finish(self, scores: np.ndarray, labels: np.ndarray) -> list[tuple[int, float]]:
        hits = [(int(self._ext[lab]), float(s)) for lab, s in zip(labels, scores, strict=True) if lab != -1]
        hits.sort(key=lambda h: (-h[1], h[0]))
        return hits

    def _compact(self) -> None:
        live = np.flatnonzero(self._live)
        if len(live) < self._n:  # every row live (a first training): labels are already 0..n-1, nothing moves
            vecs, ext = self._vecs[live], self._ext[live]  # before _n changes with the first setter
            self._vecs = vecs
            self._ext = ext
            self._live = np.ones(len(live), dtype=bool)
            self._label_of = dict(zip(self._ext.tolist(), range(len(live)), strict=True))
        self._rows_changed()
        self._train_and_fill()


def _read_index_member(archive: zipfile.ZipFile, name: str) -> faiss.Index:
    """faiss.deserialize_index of the uint8 array `name` of an npz file, read from its member in chunks."""
    with archive.open(name) as member:
        version = np.lib.format.read_magic(member)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = header(member)
        if dtype != np.uint8 or len(shape) != 1:
            raise ValueError(f"{name} is a {dtype} array of shape {shape}, not serialized index bytes")
        return faiss.read_index(faiss.PyCallbackIOReader(member.read, 1 << 22))


class HnswIndex(_AnnIndex):
    """HNSW graph (inner product) over all rows; dead rows stay in the graph until compaction."""

    kind = "hnsw"

    def __init__(self, dim: int, m: int = 32, ef_construction: int = 80, ef_search: int = 128,
                 exact_below: int = EXACT_BELOW) -> None:
        self.m, self.ef_construction, self.ef_search = m, ef_construction, ef_search
        super().__init__(dim, exact_below)

    def _new_index(self, n: int) -> faiss.Index:
        index = faiss.IndexHNSWFlat(self.dim, self.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.ef_construction
        return index

    def _train_and_fill(self) -> None:
        self.index = self._new_index(len(self._vecs))
        if len(self._vecs):
            self.index.add(self._vecs)

    def _ann_search(self, query: np.ndarray, k: int, rows: RowSet, widen: float
                    ) -> list[tuple[int, float]]:
        # A filter that keeps a fraction f of the graph needs roughly 1/f more candidates
        # visited to collect the same number of allowed ones.
        ef = int(min(1024, max(self.ef_search, 2 * k) * min(widen, 64.0)))
        params = faiss.SearchParametersHNSW(efSearch=ef, sel=self._selector(rows))
        scores, found = self.index.search(query, k, params=params)
        return self._finish(scores[0], found[0])


class IvfIndex(_AnnIndex):
    """IVF-Flat (inner product), trained on the collection and re-trained as it grows.

    How many lists a filtered search probes comes from a table measured at each training
    (`retrieval.vectors.ivf_probes`: the smallest nprobe reaching recall@10 0.97 per readable
    fraction), never fewer than `nprobe`; a file written before the table existed keeps the old
    rule (a third of the lists, times sqrt(1 / fraction)) until its next training.
    """

    kind = "ivf"
    MIN_TRAIN = 1024  # below this, rows are searched exhaustively and no lists are trained

    def __init__(self, dim: int, nprobe: int = 32, exact_below: int = EXACT_BELOW) -> None:
        self.nprobe = nprobe
        self.trained_on = 0
        self.probes: ProbeTable | None = None  # measured at training; None: not trained, or an old file
        # Wall seconds of the last (re)training's phases ("train": k-means, "fill": the lists, "calibrate"),
        # for logs and benchmarks; empty until one ran in this instance.
        self.build_seconds: dict[str, float] = {}
        super().__init__(dim, exact_below)

    def _new_index(self, n: int) -> faiss.Index:
        # sqrt(n) lists keeps >= 39 training points per list (Faiss' own floor) from MIN_TRAIN on.
        nlist = max(1, min(4096, int(math.sqrt(max(n, 1)))))
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)

    def _after_add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        if self.index.is_trained and self.count() <= 4 * self.trained_on:
            self.index.add_with_ids(vectors, labels)
        elif self.count() >= self.MIN_TRAIN:
            self._compact()  # (re)train on everything we have

    def _sync(self) -> None:
        pass  # IVF adds go straight to their lists (cheap per batch)

    def remove(self, ids: np.ndarray) -> None:
        if not self._label_of:
            return
        labels = [self._label_of[int(i)] for i in np.asarray(ids, dtype=np.int64) if int(i) in self._label_of]
        if labels and self.index.is_trained:
            self.index.remove_ids(np.asarray(labels, dtype=np.int64))
        # The lists no longer hold these rows; zero our copy too, so the next saved file holds no
        # removed vector (embeddings can be partly inverted to text). Dead rows are never read.
        self._vecs[labels] = 0.0
        super().remove(ids)

    def _train_and_fill(self) -> None:
        n = len(self._vecs)
        if n < self.MIN_TRAIN:
            self.index, self.trained_on, self.probes = self._new_index(0), 0, None
            return
        self.index = self._new_index(n)
        t0 = time.perf_counter()
        self.index.train(self._vecs)  # Faiss' k-means samples 256 rows a list of these itself
        t1 = time.perf_counter()
        self.index.add_with_ids(self._vecs, np.arange(n, dtype=np.int64))
        t2 = time.perf_counter()
        self.trained_on = n
        self._calibrate()
        self.build_seconds = {"train": t1 - t0, "fill": t2 - t1, "calibrate": time.perf_counter() - t2}

    def _calibrate(self) -> None:
        """Measure the probe table on the trained CPU index (every row is live right after a build)."""
        self.probes = calibrate(self.index, self._vecs, np.flatnonzero(self._live),
                                min_rows=max(self.exact_below, MIN_ROWS), seed=len(self._vecs))

    def _nprobe(self, widen: float, k: int = 10) -> int:
        """Lists to probe for the top k under a filter that keeps 1 / widen of the live rows."""
        nlist = self.index.nlist
        if self.probes is None:  # a file from before the table: at least a third of the lists
            base = max(self.nprobe, nlist // 3)
            return int(min(nlist, base * max(1.0, math.sqrt(widen))))
        # The k-th readable neighbour at fraction f sits about where the table's k-th does at
        # f * table.k / k: a deeper k is looked up as a stricter filter.
        fraction = min(1.0, self.probes.k / k) / widen
        return int(min(nlist, max(self.nprobe, self.probes.nprobe_for(fraction))))

    def _has_index(self) -> bool:
        return self.index.is_trained  # below MIN_TRAIN rows there are no lists to search

    def _ann_search(self, query: np.ndarray, k: int, rows: RowSet, widen: float
                    ) -> list[tuple[int, float]]:
        assert self.index.is_trained
        params = faiss.SearchParametersIVF(nprobe=self._nprobe(widen, k), sel=self._selector(rows))
        scores, found = self.index.search(query, k, params=params)
        return self._finish(scores[0], found[0])

    @classmethod
    def load(cls, path: Path, dim: int, exact_below: int = EXACT_BELOW) -> IvfIndex:
        store = super().load(path, dim, exact_below)
        assert isinstance(store, IvfIndex)
        store.trained_on = int(store.index.ntotal) if store.index.is_trained else 0
        return store

    def _serialized_size_hint(self) -> int:
        index = self.index  # IVF-Flat: each row's code and id, the centroids, a little per list and header
        return int(index.ntotal * (index.code_size + 8) + index.nlist * (4 * self.dim + 64) + (1 << 16))

    def _extra_arrays(self) -> dict[str, np.ndarray]:
        return {} if self.probes is None else self.probes.to_arrays()

    def _read_extra_arrays(self, data) -> None:
        self.probes = ProbeTable.from_arrays(data)
