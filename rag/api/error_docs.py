"""The error responses each route documents in the OpenAPI schema, all in the one error body.

Routes declare what they can answer (`responses=error_responses(*KEYED, 404)`), so `/docs`, the
`openai`-style clients generated from `/openapi.json` and schemathesis see the same statuses the
service really sends, each with the `ErrorBody` below (the shape rag/api/errors.py answers) and the headers that
come with it (`WWW-Authenticate` on a 401, `Retry-After` on a 429 or 503). FastAPI's own 422
entry is taken out of the schema: the service answers invalid input with a 400, never a 422.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")  # these four keys, nothing else

    message: str = Field(description="what was wrong and what to do; never quotes the request back")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error, authentication_error, "
                                  "rate_limit_error")
    param: str | None = Field(default=None, description="the request field at fault, where there is one")
    code: str | None = Field(default=None, description="a machine-readable reason, e.g. model_not_found")


class ErrorBody(BaseModel):
    """The one error shape of every route (OpenAI's): what the `openai` client parses."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again",
                                "schema": {"type": "integer"}}}

_ERRORS: dict[int, tuple[str, dict]] = {
    400: ("Invalid request: a body that is not JSON or does not fit the schema (the message names the field, "
          "never its value), or a proxy key's malformed user header", {}),
    401: ("Missing, malformed, unknown or revoked API key (send `Authorization: Bearer KEY`)",
          {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}}),
    403: ("A proxy key's request that names no user, or one the directory does not know", {}),
    404: ("Not found, or not readable with this key: the two answer alike", {}),
    413: ("The request body is larger than the server's max_request_bytes", {}),
    429: ("Too many questions waiting for the generator: retry after Retry-After seconds", _RETRY_AFTER),
    502: ("The answer generator refused the request", {}),
    503: ("The answer generator or the document database is unavailable: retry after Retry-After seconds",
          _RETRY_AFTER),
    504: ("The answer took longer than the server's request_timeout", {}),
}

# What every route behind a key can answer before it does anything of its own.
KEYED = (400, 401, 403)
# What a question route adds: its body, the collection, admission and the generator.
QUESTION = (*KEYED, 404, 413, 429, 502, 503, 504)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these statuses, each with the error body and its headers."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        description, headers = _ERRORS[status]
        out[status] = {"model": ErrorBody, "description": description}
        if headers:
            out[status]["headers"] = headers
    return out


def without_unanswered_422(schema: dict) -> dict:
    """The OpenAPI schema without FastAPI's automatic 422 entries and their models (never answered)."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    models = schema.get("components", {}).get("schemas", {})
    if "#/components/schemas/HTTPValidationError" not in str(schema.get("paths")):
        models.pop("HTTPValidationError", None)
        models.pop("ValidationError", None)
    return schema
