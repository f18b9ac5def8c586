"""Experiment configurations: retrieval settings (mode, rerank, k, candidates, dense feedback,
hits per document) and index settings.

Index settings (chunk size and overlap, embedder, store) need a collection built with them;
retrieval settings apply per query and never build anything. None means "as the Rag's own
settings", so the default configuration queries the collection you already ingested the way
`rag query` does. `parse_config` reads the CLI's `key=value,...` form.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any

from rag.errors import ConfigError
from rag.settings import MAX_CANDIDATES, check_max_hits_per_document

MODES = ("dense", "keyword", "hybrid")
STORES = ("faiss", "faiss-hnsw", "faiss-ivf", "memory", "pgvector")
INDEX_FIELDS = ("chunk_max_tokens", "chunk_overlap_tokens", "chunk_title_context", "embedder", "store")
_ALIASES = {"chunk": "chunk_max_tokens", "chunk_tokens": "chunk_max_tokens", "overlap": "chunk_overlap_tokens",
            "title_context": "chunk_title_context", "feedback": "dense_feedback",
            "max_per_document": "max_hits_per_document"}
_BOOLEAN_FIELDS = ("rerank", "chunk_title_context", "dense_feedback")
_INTEGER_FIELDS = ("k", "candidates", "chunk_max_tokens", "chunk_overlap_tokens", "max_hits_per_document")
_FLOAT_FIELDS = ("page_evidence",)

_TRUE, _FALSE = {"on", "true", "yes", "1"}, {"off", "false", "no", "0"}


@dataclass(frozen=True)
class Config:
    """One way of answering: how to retrieve, and (when not None) how the index is built.

    Args:
        name: the label in tables and plots (default: made from the settings that are set).
        mode: "dense", "keyword" or "hybrid".
        rerank: apply the cross-encoder to the candidates.
        k: hits kept (sources given to the generator).
        candidates: hits fetched before reranking (None: the `candidates` setting).
        dense_feedback: in hybrid mode, fuse the pseudo-relevance-feedback dense leg
            (retrieval.feedback; None: the `dense_feedback` setting).
        max_hits_per_document: at most this many of the k hits from one document, 0 for no cap
            (None: the `max_hits_per_document` setting).
        page_evidence: with one hit per document, the weight of a document's second-best chunk
            in its rank, 0..1 (retrieval.diversity.rank_pages; None: the `page_evidence` setting).
        chunk_max_tokens, chunk_overlap_tokens, chunk_title_context, embedder, store: index settings
            (None: the Rag's).
    """

    name: str | None = None
    mode: str = "hybrid"
    rerank: bool = True
    k: int = 5
    candidates: int | None = None
    dense_feedback: bool | None = None
    max_hits_per_document: int | None = None
    page_evidence: float | None = None
    chunk_max_tokens: int | None = None
    chunk_overlap_tokens: int | None = None
    chunk_title_context: bool | None = None
    embedder: str | None = None
    store: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        if not 1 <= self.k <= 100:
            raise ConfigError(f"k must be between 1 and 100, got {self.k}")
        if self.candidates is not None and not 1 <= self.candidates <= MAX_CANDIDATES:
            raise ConfigError(f"candidates must be between 1 and {MAX_CANDIDATES}, got {self.candidates}")
        if self.dense_feedback is not None and not isinstance(self.dense_feedback, bool):
            raise ConfigError(f"dense_feedback must be True or False (on/off), got {self.dense_feedback!r}")
        if self.max_hits_per_document is not None:
            check_max_hits_per_document(self.max_hits_per_document)
        if self.page_evidence is not None and not (
                isinstance(self.page_evidence, int | float) and not isinstance(self.page_evidence, bool)
                and 0 <= self.page_evidence <= 1):
            raise ConfigError(f"page_evidence must be a number between 0 and 1, got {self.page_evidence!r}")
        if self.chunk_max_tokens is not None and not 16 <= self.chunk_max_tokens <= 512:
            raise ConfigError(f"chunk_max_tokens must be between 16 and 512, got {self.chunk_max_tokens}")
        if self.chunk_overlap_tokens is not None and not 0 <= self.chunk_overlap_tokens <= 255:
            raise ConfigError(f"chunk_overlap_tokens must be between 0 and 255, got {self.chunk_overlap_tokens}")
        if self.store is not None and self.store not in STORES:
            raise ConfigError(f"unknown store {self.store!r}; choose one of: {', '.join(STORES)}")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.mode + (" + rerank" if self.rerank else ""), f"k={self.k}"]
        if self.candidates is not None:
            parts.append(f"candidates={self.candidates}")
        if self.dense_feedback is not None:
            parts.append(f"dense feedback {'on' if self.dense_feedback else 'off'}")
        if self.max_hits_per_document is not None:
            parts.append(f"max {self.max_hits_per_document} per document" if self.max_hits_per_document
                         else "no per-document cap")
        if self.page_evidence is not None:
            parts.append(f"page evidence {self.page_evidence:g}")
        if self.chunk_max_tokens is not None or self.chunk_overlap_tokens is not None:
            parts.append(f"chunks={self.chunk_max_tokens or '-'}/{self.chunk_overlap_tokens or 0}")
        if self.chunk_title_context is not None:
            parts.append(f"title context {'on' if self.chunk_title_context else 'off'}")
        if self.embedder is not None:
            parts.append(f"embedder={self.embedder.rstrip('/').rpartition('/')[2]}")
        if self.store is not None:
            parts.append(f"store={self.store}")
        return ", ".join(parts)

    def index_settings(self) -> dict[str, Any]:
        """The index settings this configuration sets (the others are the Rag's)."""
        return {f: getattr(self, f) for f in INDEX_FIELDS if getattr(self, f) is not None}


def parse_config(text: str) -> Config:
    """`mode=dense,rerank=off,k=10,chunk=100,overlap=16,dense_feedback=off,max_hits_per_document=1` as a Config.

    Raises:
        ConfigError: an unknown key or a bad value, with the valid keys.
    """
    names = {f.name: f for f in fields(Config)}
    values: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = _ALIASES.get(key.strip(), key.strip().replace("-", "_"))
        if not sep or key not in names:
            valid = ", ".join([*names, *_ALIASES])
            raise ConfigError(f"cannot read config {text!r}: {part!r} is not key=value with a key among {valid}")
        values[key] = _value(key, value.strip())
    return Config(**values)


def grid(**axes: list[Any]) -> list[Config]:
    """Every combination of the given values: grid(mode=["dense", "hybrid"], rerank=[False, True])."""
    keys = list(axes)
    return [Config(**dict(zip(keys, combo, strict=True))) for combo in itertools.product(*axes.values())]


def _value(key: str, value: str) -> Any:
    if key in _BOOLEAN_FIELDS:
        if value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key} must be on or off, got {value!r}")
    if key in _INTEGER_FIELDS:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key} must be a whole number, got {value!r}") from None
    if key in _FLOAT_FIELDS:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    return value
