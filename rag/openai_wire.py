"""The OpenAI wire format's errors and request bodies, shared by `rag serve` and `rag engine serve`.

Errors are `{"error": {"message", "type", "param", "code"}}` with the HTTP status the `openai`
client maps to its typed exceptions. Bodies are read as raw bytes so that every way one can be
malformed (too large, not UTF-8, not JSON, not an object, wrong fields) is a clear 4xx.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 502: "server_error",
    503: "service_unavailable", 504: "timeout",
}

Body = TypeVar("Body", bound=BaseModel)


class ApiError(Exception):
    """An error answered to the client as is (the message must not leak internals or secrets)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def validation_error(exc: ValidationError) -> ApiError:
    """One 400 naming every bad field (`messages.0.role: Input should be ...`)."""
    errors = exc.errors()
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    first = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(p) for p in first if p != "body") or None
    return ApiError(400, "invalid request: " + "; ".join(parts), param=param)


def parse_json_body(raw: bytes, schema: type[Body], max_bytes: int) -> Body:
    """Validate a raw request body as `schema`.

    Raises:
        ApiError: 413 past max_bytes; 400 for a body that is not UTF-8, not JSON, not an object,
            or does not fit the schema.
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} ({where})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if has_lone_surrogate(data):
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate escape: "
                            "send valid Unicode")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def has_lone_surrogate(value: object) -> bool:
    """Whether a decoded JSON value holds a string that is not valid Unicode (a lone surrogate).

    JSON allows "\\ud800" escapes that decode to text no UTF-8 encoder (tokenizers, SQLite, logs)
    accepts; refusing them here keeps them from failing deep inside the pipeline.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False
