"""The OpenAI wire format's errors and request bodies, shared by `rag serve` and `rag engine serve`.

Errors are `{"error": {"message", "type", "param", "code"}}` with the HTTP status the `openai`
client maps to its typed exceptions; both servers answer every error, on every route, in this
one shape. Bodies are read as raw bytes, only after the caller is authenticated and never past a
size cap, so that every way one can be malformed (too large, not UTF-8, not JSON, not an object,
wrong fields) is a clear 4xx. No message quotes the request back: it names the field and what
was wrong with it, never the value (a 1 MB question is not echoed, a pasted secret not reflected).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request

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


# A location part that is a schema's field name or a list index. Anything else is left out: a
# key the client made up (inside a free-form object) is its input and is not quoted back, and
# pydantic's union-member tags ("constrained-str") mean nothing to a client.
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_ERRORS_LISTED = 5


def _location(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body" and (isinstance(p, int) or _FIELD_NAME.fullmatch(str(p)))]
    return ".".join(parts)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """One 400 naming the bad fields (`messages.0.role: Input should be ...`), never their values.

    Pydantic's messages say what was expected, not what was given. An unknown field's name is the
    client's own text, so it is not named either: the message points at the schema instead.
    """
    errors = exc.errors()
    parts = []
    for err in errors[:_MAX_ERRORS_LISTED]:
        loc = _location(_where(err))
        if err.get("type") == "extra_forbidden":
            msg = "a field this API does not take (GET /openapi.json lists the fields)"
        else:
            msg = str(err.get("msg"))
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > _MAX_ERRORS_LISTED:
        parts.append(f"and {len(errors) - _MAX_ERRORS_LISTED} more")
    param = (_location(_where(errors[0])) or None) if errors else None
    return ApiError(400, "invalid request: " + "; ".join(parts), param=param)


def _where(err: dict) -> tuple:
    loc = tuple(err.get("loc", ()))
    return loc[:-1] if err.get("type") == "extra_forbidden" else loc  # the object, not the made-up key


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw request body, read only up to max_bytes.

    A declared Content-Length past the cap is refused before a byte is read; a chunked body is
    refused as soon as it passes the cap, so a client cannot make the server buffer more. The
    body is kept on the request (Starlette's own cache), so later readers (the audit log) reuse it.

    Raises:
        ApiError: 413 past max_bytes.
    """
    cached = getattr(request, "_body", None)
    if cached is not None:
        if len(cached) > max_bytes:
            raise ApiError(413, f"the request body is larger than {max_bytes} bytes")
        return cached
    too_large = ApiError(413, f"the request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        request._body = b""  # nobody reads it after us (the audit entry goes without the question)
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            request._body = b""
            raise too_large
        chunks.append(chunk)
    raw = request._body = b"".join(chunks)
    return raw


def _refuse_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, which JSON does not.
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes, schema: type[Body], max_bytes: int) -> Body:
    """Validate a raw request body as `schema`.

    Raises:
        ApiError: 413 past max_bytes; 400 for a body that is not UTF-8, not JSON, not an object,
            or does not fit the schema.
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} ({where})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError:
        # NaN/Infinity, or an integer of more than 4300 digits (Python's conversion limit).
        raise ApiError(400, "the request body is not valid JSON: a number is not finite or too long") from None
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
