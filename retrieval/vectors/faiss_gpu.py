"""IVF on a GPU for large collections: build there, store a CPU index, search there with the ACL still applied.

`GpuIvfIndex` is an `IvfIndex` (same rows, labels, file format) whose training and filling run on a
GPU once the collection is large, and whose filtered searches go to a GPU replica of the lists.
The stored file stays a CPU `IndexIVFFlat`, so a machine without a GPU (or without faiss-gpu) loads
it as a plain `faiss-ivf` index.

The ACL filter on the GPU. Faiss' classic GPU kernels (GpuIndexFlat, GpuIndexIVFFlat, GpuIndexIVFPQ)
take `SearchParameters.sel` since 1.14.2 but ignore it: only the cuVS-backed indexes (faiss-gpu-cuvs)
turn the selector into a bitset filter. So the selector is passed only to a device that honours it,
and every GPU answer is post-filtered with the same readable-label set either way. Without a
selector the search over-fetches: depth k*f with f from the filter's selectivity, doubled while
fewer than k readable hits come back; past `MAX_DEPTH` (Faiss' GPU top-k limit, 2048) or when the
probed lists run out, the CPU index answers with the selector inside the search (and the exact
path behind it, as for every IVF search). An unreadable chunk is never returned and a principal who
may read k chunks gets k.

`Device` is the seam: `FaissGpu` is the real one; the contract suite runs `SelectorlessCpu`, a CPU
IVF replica that refuses `params.sel`, so the over-fetch/deepen/fallback path is tested without a GPU.
A `GpuPlacement` (a device and the size from which a collection uses it) is what the stores pass
down to the "faiss-ivf" indexes they make or load (`retrieval.stores.CollectionStores` resolves the
`faiss_gpu` setting into one), so each store honours the setting it was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import faiss
import numpy as np

from rag.errors import ConfigError
from retrieval.vectors import FAISS_GPU_MODES
from retrieval.vectors.faiss_ann import EXACT_BELOW, IvfIndex
from retrieval.vectors.row_sets import RowSet

__all__ = ["FAISS_GPU_MODES", "Device", "FaissGpu", "GpuIvfIndex", "GpuPlacement", "SelectorlessCpu",
           "check_gpu", "gpu_available", "resolve_placement"]
# "auto" uses the GPU from this many live rows on: below it a CPU IVF search takes a few ms and the
# copy to the device (and its memory) does not pay.
AUTO_MIN_ROWS = 1_000_000
# Faiss' GPU k-selection limit (GPU_MAX_SELECTION_K, faiss/gpu/utils/DeviceDefs.cuh): neither k nor
# nprobe may exceed it. An over-fetch deeper than this cannot run on the GPU, and a filter that
# needs it (k=10 at under ~0.5% readable) is served as well by the CPU index with the selector.
MAX_DEPTH = 2048
INSTALL_HINT = ("install a GPU build of Faiss in place of faiss-cpu (they share the `faiss` module): "
                "pip uninstall -y faiss-cpu && pip install 'faiss-gpu==1.15.1' "
                "(CUDA 12; or faiss-gpu-cuvs==1.15.1 for CUDA 13 + cuVS), or set faiss_gpu = \"off\"")


class Device(Protocol):
    """Where the GPU replica lives: copies an index there and back, and says what its search takes."""

    honours_selector: bool  # True only where `params.sel` really filters (cuVS builds)

    def to_device(self, index: faiss.Index) -> faiss.Index: ...

    def to_host(self, index: faiss.Index) -> faiss.Index: ...


class FaissGpu:
    """A real GPU through faiss-gpu: one `StandardGpuResources` on device `device`."""

    def __init__(self, device: int = 0) -> None:
        if not gpu_available():
            raise ConfigError(f"faiss_gpu = \"on\" but this Faiss ({faiss.__version__}) sees no GPU; {INSTALL_HINT}")
        self.device = device
        self.resources = faiss.StandardGpuResources()
        self.honours_selector = _cuvs_filters()
        self._options = faiss.GpuClonerOptions()
        self._options.use_cuvs = self.honours_selector

    def to_device(self, index: faiss.Index) -> faiss.Index:
        return faiss.index_cpu_to_gpu(self.resources, self.device, index, self._options)

    def to_host(self, index: faiss.Index) -> faiss.Index:
        return faiss.index_gpu_to_cpu(index)


class _SelectorlessReplica:
    """A CPU IVF index that behaves like a classic GPU one: a search that carries a selector is refused."""

    def __init__(self, index: faiss.Index) -> None:
        self.index = faiss.clone_index(index)
        self.num_searches = 0
        self.depths: list[int] = []

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self.index.is_trained)

    def train(self, vectors: np.ndarray) -> None:
        self.index.train(vectors)

    def add_with_ids(self, vectors: np.ndarray, labels: np.ndarray) -> None:
        self.index.add_with_ids(vectors, labels)

    def search(self, query: np.ndarray, k: int, params: faiss.SearchParametersIVF | None = None):
        if params is not None and params.sel is not None:
            raise RuntimeError("this stand-in, like Faiss' classic GPU indexes, has no ID selector")
        if k > MAX_DEPTH or (params is not None and params.nprobe > MAX_DEPTH):
            raise RuntimeError(f"k and nprobe must be <= {MAX_DEPTH} on the GPU")
        self.num_searches += 1
        self.depths.append(k)
        return self.index.search(query, k, params=params)


class SelectorlessCpu:
    """The GPU's limitation on a CPU: replicas are CPU IVF indexes that refuse `params.sel` (tests, benches)."""

    honours_selector = False

    def __init__(self) -> None:
        self.num_builds = 0

    def to_device(self, index: faiss.Index) -> _SelectorlessReplica:
        return _SelectorlessReplica(index)

    def to_host(self, index: faiss.Index) -> faiss.Index:
        inner = index.index if isinstance(index, _SelectorlessReplica) else index
        return faiss.clone_index(inner)


def gpu_available() -> bool:
    """Whether the installed Faiss is a GPU build that sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _cuvs_filters() -> bool:
    """cuVS-backed GPU indexes filter by IDSelector from Faiss 1.14.2 on (faiss PR #4858)."""
    version = tuple(int(p) for p in faiss.__version__.split(".")[:3] if p.isdigit())
    return "CUVS" in faiss.get_compile_options().upper() and version >= (1, 14, 2)


@dataclass(frozen=True)
class GpuPlacement:
    """Where a "faiss-ivf" index builds and searches: on `device` once a collection holds `min_rows` live rows."""

    device: Device
    min_rows: int = AUTO_MIN_ROWS

    def __post_init__(self) -> None:
        if self.min_rows < 0:
            raise ValueError(f"min_rows must be >= 0, got {self.min_rows}")


def check_gpu(mode: str) -> None:
    """Check a `faiss_gpu` mode without touching a GPU: "on" must have one (fail at startup, not at the
    first large build).

    Raises:
        ValueError: for a mode outside FAISS_GPU_MODES.
        ConfigError: "on" without a GPU build of Faiss or without a visible GPU (with the install hint).
    """
    if mode not in FAISS_GPU_MODES:
        raise ValueError(f"faiss_gpu must be one of {', '.join(FAISS_GPU_MODES)}, got {mode!r}")
    if mode == "on" and not gpu_available():
        raise ConfigError(f"faiss_gpu = \"on\" but this Faiss ({faiss.__version__}) sees no GPU; {INSTALL_HINT}")


def resolve_placement(mode: str) -> GpuPlacement | None:
    """The placement for the `faiss_gpu` setting: None for "off" (and "auto" without a GPU).

    Makes a `FaissGpu` (its `StandardGpuResources`) for "on" and for "auto" with a GPU: call it
    once per store set and share the result among its collections.

    Raises:
        ValueError, ConfigError: as `check_gpu`.
    """
    check_gpu(mode)
    if mode == "off" or (mode == "auto" and not gpu_available()):
        return None
    return GpuPlacement(FaissGpu())


class GpuIvfIndex(IvfIndex):
    """IVF-Flat built and searched on a device once the collection has `min_rows` live rows.

    Counters beside IvfIndex's: `num_gpu_builds`, `num_gpu_searches` (answered on the device),
    `num_deepenings` (over-fetch rounds past the first) and `num_gpu_fallbacks` (sent to the CPU
    index with the selector: too deep for the device, or its probed lists ran out).
    """

    def __init__(self, dim: int, device: Device, nprobe: int = 32, exact_below: int = EXACT_BELOW,
                 min_rows: int = AUTO_MIN_ROWS) -> None:
        self.device = device
        self.min_rows = min_rows
        self.replica: faiss.Index | None = None
        self.num_gpu_builds = self.num_gpu_searches = self.num_deepenings = self.num_gpu_fallbacks = 0
        super().__init__(dim, nprobe=nprobe, exact_below=exact_below)

    def _uses_device(self) -> bool:
        return self.count() >= self.min_rows

    def _train_and_fill(self) -> None:
        n = len(self._vecs)
        self.replica = None
        if n < self.MIN_TRAIN or not self._uses_device():
            super()._train_and_fill()
            return
        # k-means and the list fill are the GPU's work; the index that is kept and saved is a CPU one.
        on_device = self.device.to_device(self._new_index(n))
        on_device.train(self._vecs)
        on_device.add_with_ids(self._vecs, np.arange(n, dtype=np.int64))
        self.index = self.device.to_host(on_device)
        self.trained_on = n
        self.num_gpu_builds += 1
        self.replica = on_device
        self._calibrate()  # on the CPU copy: its searches honour the selector on any build

    def _after_add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        index_before = self.index
        super()._after_add(labels, vectors)
        # Rows added to the CPU lists (no rebuild) go to the replica too; removed rows stay there
        # until the next rebuild, which is safe: only live readable labels survive the post-filter.
        if self.replica is not None and self.index is index_before and self.index.is_trained:
            self.replica.add_with_ids(vectors, labels)

    def _ann_search(self, query: np.ndarray, k: int, rows: RowSet, widen: float
                    ) -> list[tuple[int, float]]:
        if not self._uses_device():
            return super()._ann_search(query, k, rows, widen)
        if self.replica is None:  # loaded from a file, or grown past min_rows since the last build
            self.replica = self.device.to_device(self.index)
        nprobe = min(MAX_DEPTH, self._nprobe(widen, k))
        if self.device.honours_selector:
            return self._selector_search(query, k, rows, nprobe)
        # Expect k * widen candidates to hold k readable ones; start at twice that.
        depth = k * max(2, math.ceil(2 * widen))
        first = True
        while depth <= MAX_DEPTH:
            if not first:
                self.num_deepenings += 1
            first = False
            scores, found = self.replica.search(query, depth, params=faiss.SearchParametersIVF(nprobe=nprobe))
            scores, found = scores[0], found[0]
            keep = rows.contains(found)  # the ACL filter, applied to every GPU answer
            if keep.sum() >= k:
                self.num_gpu_searches += 1
                return self._finish(scores[keep], found[keep])[:k]
            if found[-1] < 0:
                break  # the probed lists hold fewer than `depth` rows: deeper finds nothing new
            depth *= 2
        self.num_gpu_fallbacks += 1
        return super()._ann_search(query, k, rows, widen)

    def _selector_search(self, query: np.ndarray, k: int, rows: RowSet, nprobe: int
                         ) -> list[tuple[int, float]]:
        params = faiss.SearchParametersIVF(nprobe=nprobe, sel=self._selector(rows))
        scores, found = self.replica.search(query, k, params=params)
        keep = rows.contains(found[0])  # post-check: the device's filter is not trusted alone
        self.num_gpu_searches += 1
        return self._finish(scores[0][keep], found[0][keep])

    @classmethod
    def load_with(cls, path, dim: int, device: Device, exact_below: int = EXACT_BELOW,
                  min_rows: int = AUTO_MIN_ROWS) -> GpuIvfIndex:
        """Load a saved IVF file (written by IvfIndex or GpuIvfIndex: the same CPU format)."""
        plain = IvfIndex.load(path, dim, exact_below)
        store = cls(dim, device, nprobe=plain.nprobe, exact_below=exact_below, min_rows=min_rows)
        store.index, store.trained_on, store.probes = plain.index, plain.trained_on, plain.probes
        store._vecs, store._ext, store._live = plain._vecs, plain._ext, plain._live
        store._label_of = plain._label_of
        return store
