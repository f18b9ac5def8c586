"""Request bodies of the OpenAI-compatible routes (unknown fields ignored, as clients send many)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rag.openai_wire import Body, parse_json_body

MAX_BODY_BYTES = 2_000_000
MAX_TOKENS_LIMIT = 8192


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    seed: int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Validate a raw request body, with OpenAI-style 4xx for every way it can be wrong."""
    return parse_json_body(raw, model, MAX_BODY_BYTES)
