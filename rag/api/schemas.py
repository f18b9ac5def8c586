"""Request and response bodies of the API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from rag.openai_wire import has_lone_surrogate


class QueryRequest(BaseModel):
    question: str = Field(min_length=1, max_length=4000, description="the question")
    k: int = Field(default=5, ge=1, le=50, description="number of sources")
    generate: bool = Field(default=True, description="generate an answer, or retrieve only")
    collection: str | None = Field(default=None, description="collection (default: 'default')")
    mode: Literal["dense", "keyword", "hybrid"] | None = Field(
        default=None, description="retrieval legs (default: the server's setting, hybrid)")
    stream: bool = Field(default=False, description="server-sent events: citations, text deltas, then timings")

    @field_validator("question", "collection")
    @classmethod
    def _valid_unicode(cls, v: str | None) -> str | None:
        if v is not None and has_lone_surrogate(v):
            raise ValueError("holds a lone UTF-16 surrogate escape: send valid Unicode")
        return v


class CitationOut(BaseModel):
    number: int
    document: str
    source: str
    chunk: int
    score: float
    text: str


class QueryResponse(BaseModel):
    question: str
    user: str
    answer: str | None
    citations: list[CitationOut]
    timings_ms: dict[str, float]
    usage: dict[str, int] | None = None


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    generator: str
    detail: str | None = None
    in_flight: int = 0
    queued: int = 0
