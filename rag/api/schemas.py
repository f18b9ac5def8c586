"""Request and response bodies of the API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rag.openai_wire import has_lone_surrogate

MAX_QUESTION_CHARS = 4000


class QueryRequest(BaseModel):
    # Strict: "generate": "yes" or "k": true is a 400, not a guess; an unknown field is a 400 too
    # (a misspelt "colection" would otherwise search the default collection).
    model_config = ConfigDict(strict=True, extra="forbid")

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS, description="the question")
    k: int = Field(default=5, ge=1, le=50, description="number of sources")
    generate: bool = Field(default=True, description="generate an answer, or retrieve only")
    collection: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                   description="collection (default: 'default')")
    mode: Literal["dense", "keyword", "hybrid"] | None = Field(
        default=None, description="retrieval legs (default: the server's setting, hybrid)")
    stream: bool = Field(default=False, description="server-sent events: citations, text deltas, then done")

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
    score: float = Field(description="raw: the cross-encoder's logit, or the search's score when not reranked")
    text: str
    relevance: float | None = Field(default=None, description=(
        "probability (0-1) that the source is relevant: sigmoid of the cross-encoder's logit; "
        "null when not reranked, as search scores are not probabilities"))
    rank: int | None = Field(default=None, description="1 = the best of the retrieved sources")


class QueryResponse(BaseModel):
    question: str
    user: str
    answer: str | None
    answer_mode: Literal["extract", "generate"] | None = Field(default=None, description=(
        "how the answer was written: 'extract' (sentences quoted from the sources, each with its [n]) "
        "or 'generate' (the generator's words); null when generate is false"))
    citations: list[CitationOut]
    # Per-stage times for admin keys only (null for others): the keyword search's time grows with
    # the chunks that contain a term, readable or not, so it would tell others what exists.
    timings_ms: dict[str, float] | None = Field(default=None, description="stage timings; admin keys only")
    usage: dict[str, int] | None = None


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    generator: str
    database: str | None = None  # pgvector only: "ok" or "not answering"
    detail: str | None = None
    in_flight: int = 0
    queued: int = 0
