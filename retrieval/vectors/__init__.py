"""The vector index kinds of the embedded backend, by name: exact (memory, Faiss flat) and
approximate (HNSW, IVF), each a `retrieval.base.VectorIndex`."""

from __future__ import annotations

from pathlib import Path

from rag.errors import ConfigError
from retrieval.base import VectorIndex

# Vector stores that sit beside the SQLite catalog (the embedded default). "faiss" is exact
# (flat); the approximate ones keep the ACL filter inside the search too.
VECTOR_INDEX_KINDS = ("faiss", "faiss-hnsw", "faiss-ivf", "memory")

# The `faiss_gpu` setting for this process ("auto" | "off" | "on"): whether "faiss-ivf" builds and
# searches on a GPU (retrieval/vectors/faiss_gpu.py). A process-wide choice, as the GPU is one.
_faiss_gpu = "off"


def set_faiss_gpu(mode: str) -> None:
    """Set the `faiss_gpu` mode of the "faiss-ivf" indexes made or loaded from now on.

    Raises:
        ValueError: for a mode other than "auto", "off", "on".
        ConfigError: "on" where Faiss has no GPU (the message says what to install).
    """
    from retrieval.vectors.faiss_gpu import resolve_device

    resolve_device(mode)  # fail now, at startup, rather than at the first large build
    global _faiss_gpu
    _faiss_gpu = mode


def _ivf_device():
    from retrieval.vectors.faiss_gpu import resolve_device

    return resolve_device(_faiss_gpu)


def make_vector_index(kind: str, dim: int, exact_below: int | None = None) -> VectorIndex:
    """Create an empty store of a registered kind.

    Args:
        kind: one of VECTOR_INDEX_KINDS.
        dim: vector dimension.
        exact_below: for the approximate kinds, allow-lists of at most this many rows are
            searched exactly (0: always search the graph / lists); None keeps the store's
            default. The exact kinds ignore it.

    Raises:
        ConfigError: for an unknown kind.
    """
    if kind == "memory":
        from retrieval.vectors.memory import MemoryIndex

        return MemoryIndex(dim)
    if kind == "faiss":
        from retrieval.vectors.faiss_flat import FlatIndex

        return FlatIndex(dim)
    if kind == "faiss-ivf" and (device := _ivf_device()) is not None:
        from retrieval.vectors.faiss_gpu import GpuIvfIndex

        return GpuIvfIndex(dim, device) if exact_below is None else GpuIvfIndex(dim, device, exact_below=exact_below)
    if kind in ("faiss-hnsw", "faiss-ivf"):
        from retrieval.vectors.faiss_ann import HnswIndex, IvfIndex

        cls = HnswIndex if kind == "faiss-hnsw" else IvfIndex
        return cls(dim) if exact_below is None else cls(dim, exact_below=exact_below)
    raise ConfigError(f"unknown vector store {kind!r}; choose one of: {', '.join(VECTOR_INDEX_KINDS)}")


def load_vector_index(kind: str, path: Path, dim: int, exact_below: int | None = None) -> VectorIndex:
    """Load a store saved by `save` (only the Faiss kinds persist); `exact_below` as in make_vector_index."""
    from retrieval.vectors.faiss_ann import HnswIndex, IvfIndex
    from retrieval.vectors.faiss_flat import FlatIndex

    if kind == "faiss":
        return FlatIndex.load(path, dim)
    if kind == "faiss-ivf" and (device := _ivf_device()) is not None:
        from retrieval.vectors.faiss_gpu import EXACT_BELOW, GpuIvfIndex

        return GpuIvfIndex.load_with(path, dim, device, EXACT_BELOW if exact_below is None else exact_below)
    cls = {"faiss-hnsw": HnswIndex, "faiss-ivf": IvfIndex}[kind]
    return cls.load(path, dim) if exact_below is None else cls.load(path, dim, exact_below)
