"""Request bodies of the OpenAI-compatible engine server.

Unknown fields are ignored, as OpenAI clients expect; known ones are strict (`"temperature": "1"`
or `"stream": 1` is a 400, never coerced; an int for a float is fine) and capped, so no field
carries more than the engine could use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_STOPS = 16
MAX_STOP_CHARS = 200
_INT64 = 2**63 - 1


class _Body(BaseModel):
    # Clients send fields we do not know (user, logit_bias, metadata, ...): ignore them.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SamplingFields(_Body):
    """What both endpoints take; ranges follow OpenAI's, upper bounds on max_tokens come from the model."""

    model: str | None = Field(default=None, max_length=256)
    max_tokens: StrictInt | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # vLLM's extras: kept because clients of `vllm serve` send them.
    top_k: StrictInt = Field(default=-1, le=1_000_000)
    ignore_eos: StrictBool = False
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # The prefix-cache namespace of this request (vLLM's field): only requests with the same salt
    # share KV blocks. It is only as trustworthy as the caller that sets it (see the package doc).
    cache_salt: str | None = Field(default=None, max_length=256)
    # vLLM's field: each choice carries the token ids it adds (`token_ids`), and a stream sends a
    # chunk for every step that made tokens, text or not (benchmarks count tokens per chunk; a
    # model without a tokenizer streams nothing else).
    return_token_ids: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported: send one request per completion")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _check_salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("cache_salt must be a non-empty string when given")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for legacy completions
    echo: StrictBool = False
    logprobs: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported: send one request per prompt")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v
