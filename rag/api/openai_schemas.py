"""Request bodies of the OpenAI-compatible routes (unknown fields ignored, as clients send many)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rag.api.errors import ApiError

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


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a raw request body, with OpenAI-style 400s for every way it can be wrong."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param or None) from None
