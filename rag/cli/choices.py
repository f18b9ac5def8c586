"""Choices of the CLI's options, as enums: typer checks them before any model loads and lists them in --help."""

from __future__ import annotations

from enum import Enum, StrEnum


class StoreChoice(StrEnum):
    faiss = "faiss"
    faiss_hnsw = "faiss-hnsw"
    faiss_ivf = "faiss-ivf"
    memory = "memory"
    pgvector = "pgvector"


class ModeChoice(StrEnum):
    dense = "dense"
    keyword = "keyword"
    hybrid = "hybrid"


def plain(value: object) -> object:
    """An enum member as its value (settings and the library take plain strings); anything else as it is."""
    return value.value if isinstance(value, Enum) else value
