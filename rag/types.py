"""Plain data types shared by every package: Document, Chunk, Hit, Citation, Answer.

Stdlib only, so ingest, retrieval and generation can all import it without a cycle.
ACLs are frozensets of principal strings: "user:NAME", "group:NAME" or "public".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Document:
    """One source (a file or a JSONL record) after parsing, before chunking.

    `key` identifies the document inside its collection (the absolute resolved path,
    or "/abs/FILE.jsonl#ID" for a JSONL record) and is what incremental ingest matches on.
    `acl` is None when the source says nothing (then the stored ACL is kept on update,
    or the source's default applies).
    """

    key: str
    source: str
    text: str
    content_hash: str
    acl: frozenset[str] | None
    title: str | None = None
    elements: tuple[Element, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Element:
    """A parsed piece of a document: a title, paragraph, list item, table..."""

    kind: str  # unstructured's category: Title, NarrativeText, ListItem, Table, ...
    text: str
    page: int | None = None


@dataclass(frozen=True)
class Chunk:
    """A piece of a document small enough to embed; inherits the document's ACL."""

    document_key: str
    index: int
    text: str
    num_tokens: int
    heading: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    """A retrieved chunk with its score (higher is better) and where it came from."""

    chunk_id: int
    document_key: str
    source: str
    chunk_index: int
    text: str
    score: float
    heading: str | None = None
    title: str | None = None
    acl: frozenset[str] = frozenset()
    # A source read with its page's second chunk (retrieval.second_chunks): that chunk's id; the
    # text then holds both chunks, in document order.
    joined_chunk_id: int | None = None


@dataclass(frozen=True)
class Citation:
    """A numbered source in an answer: [n] in the text points here."""

    number: int
    document_key: str
    source: str
    chunk_index: int
    score: float  # raw: the cross-encoder's logit, or the search's own score when not reranked
    text: str
    # What people are shown (rag.relevance): a probability of relevance for reranked hits, else None.
    relevance: float | None = None
    rank: int | None = None  # 1 = the best of the retrieved hits (citations are in document order)
    joined_chunk_id: int | None = None  # the second chunk the text also holds (retrieval.second_chunks)


@dataclass
class Answer:
    """What a query returns: the generated text (or None), its citations and timings."""

    question: str
    text: str | None
    citations: list[Citation]
    hits: list[Hit]
    timings: dict[str, float] = field(default_factory=dict)
