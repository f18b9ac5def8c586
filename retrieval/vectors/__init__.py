"""The vector index kinds of the embedded backend, by name: exact (memory, Faiss flat) and
approximate (HNSW, IVF), each a `retrieval.base.VectorIndex`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rag.errors import ConfigError
from retrieval.base import VectorIndex

if TYPE_CHECKING:
    from retrieval.vectors.faiss_gpu import GpuPlacement

# Vector stores that sit beside the SQLite catalog (the embedded default). "faiss" is exact
# (flat); the approximate ones keep the ACL filter inside the search too.
VECTOR_INDEX_KINDS = ("faiss", "faiss-hnsw", "faiss-ivf", "memory")

# The `faiss_gpu` setting's values: whether "faiss-ivf" builds and searches on a GPU
# (retrieval/vectors/faiss_gpu.py). Each store set resolves its own (`CollectionStores`) and hands
# the resulting `GpuPlacement` to the indexes it makes or loads: no process-wide state.
FAISS_GPU_MODES = ("auto", "off", "on")


def make_vector_index(kind: str, dim: int, exact_below: int | None = None,
                      gpu: GpuPlacement | None = None) -> VectorIndex:
    """Create an empty store of a registered kind.

    Args:
        kind: one of VECTOR_INDEX_KINDS.
        dim: vector dimension.
        exact_below: for the approximate kinds, allow-lists of at most this many rows are
            searched exactly (0: always search the graph / lists); None keeps the store's
            default. The exact kinds ignore it.
        gpu: where a "faiss-ivf" index builds and searches on a GPU (None: the CPU); the other
            kinds ignore it.

    Raises:
        ConfigError: for an unknown kind.
    """
    if kind == "memory":
        from retrieval.vectors.memory import MemoryIndex

        return MemoryIndex(dim)
    if kind == "faiss":
        from retrieval.vectors.faiss_flat import FlatIndex

        return FlatIndex(dim)
    if kind == "faiss-ivf" and gpu is not None:
        from retrieval.vectors.faiss_gpu import EXACT_BELOW, GpuIvfIndex

        return GpuIvfIndex(dim, gpu.device, exact_below=EXACT_BELOW if exact_below is None else exact_below,
                           min_rows=gpu.min_rows)
    if kind in ("faiss-hnsw", "faiss-ivf"):
        from retrieval.vectors.faiss_ann import HnswIndex, IvfIndex

        cls = HnswIndex if kind == "faiss-hnsw" else IvfIndex
        return cls(dim) if exact_below is None else cls(dim, exact_below=exact_below)
    raise ConfigError(f"unknown vector store {kind!r}; choose one of: {', '.join(VECTOR_INDEX_KINDS)}")


def load_vector_index(kind: str, path: Path, dim: int, exact_below: int | None = None,
                      gpu: GpuPlacement | None = None) -> VectorIndex:
    """Load a store saved by `save` (only the Faiss kinds persist); `exact_below` and `gpu` as in
    make_vector_index (the saved IVF file is a CPU index either way)."""
    from retrieval.vectors.faiss_ann import HnswIndex, IvfIndex
    from retrieval.vectors.faiss_flat import FlatIndex

    if kind == "faiss":
        return FlatIndex.load(path, dim)
    if kind == "faiss-ivf" and gpu is not None:
        from retrieval.vectors.faiss_gpu import EXACT_BELOW, GpuIvfIndex

        return GpuIvfIndex.load_with(path, dim, gpu.device, EXACT_BELOW if exact_below is None else exact_below,
                                     gpu.min_rows)
    cls = {"faiss-hnsw": HnswIndex, "faiss-ivf": IvfIndex}[kind]
    return cls.load(path, dim) if exact_below is None else cls.load(path, dim, exact_below)
