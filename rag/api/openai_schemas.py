"""Request bodies of the OpenAI-compatible routes.

Unknown fields are ignored, as clients send many (user, logit_bias, metadata, ...); known ones
are strict: `"stream": "yes"` or `"max_tokens": true` is a 400, never a guess (an int for a float
field is fine, as in JSON Schema). Every string and list has a cap, so no field can carry more
than the service would ever use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rag.conversation import MAX_MESSAGE_CHARS, MAX_MESSAGES

MAX_TOKENS_LIMIT = 8192
MAX_STOP_CHARS = 200
_INT64 = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts ({"type": "text", "text": ...}; rag/conversation.py checks them).
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | \
        Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None


class ChatCompletionRequest(_Body):
    model: str = Field(min_length=1, max_length=200)
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes at most 4 non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops
