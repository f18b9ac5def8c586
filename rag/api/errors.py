"""Map the RagError tree to HTTP status codes (the only place that does).

One error shape on every route: OpenAI's `{"error": {"message", "type", "param", "code"}}`, which
the `openai` client and chat front ends parse, and which /v1/query, /healthz and the rest answer
too. An invalid request is a 400 everywhere (FastAPI's 422 is not used). A message never carries
text the caller may not read, nor quotes the request back: internal errors are logged (type and
stack, no message: rag/error_log.py) and answered with a generic message.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag.error_log import log_exception
from rag.errors import (
    AuthenticationError,
    ConfigError,
    DeadlineExceeded,
    GenerationError,
    GeneratorUnavailable,
    NotFoundError,
    OverloadedError,
    PermissionDenied,
    RagError,
    StoreUnavailable,
)
from rag.openai_wire import ApiError, error_body, validation_error

log = logging.getLogger(__name__)

# Most specific first.
_STATUS = [
    (AuthenticationError, 401),
    (PermissionDenied, 403),
    (NotFoundError, 404),
    (ConfigError, 422),
    (OverloadedError, 429),
    (GeneratorUnavailable, 503),
    (StoreUnavailable, 503),
    (DeadlineExceeded, 504),
    (GenerationError, 502),
]

# Seconds a client waits before retrying while the database is away (a restart takes a few).
STORE_RETRY_AFTER = 5


def status_for(error: RagError) -> int:
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return 500


def http_status(status: int) -> int:
    """The status answered: invalid input is 400 (the openai client's BadRequestError), never 422."""
    return 400 if status == 422 else status


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    status = http_status(status)
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def rag_error_response(request: Request, exc: RagError) -> JSONResponse:
    status = status_for(exc)
    headers = None
    if status == 429:
        headers = {"Retry-After": str(int(getattr(exc, "retry_after", 1)))}
    if isinstance(exc, StoreUnavailable):
        # The database is away (stopped, restarting, unreachable): worth retrying, as for a 429.
        # Its address stays in the log (never its password: the store masks every DSN it names).
        log.error("document store unavailable: %s", exc)
        return error_response(request, 503, "the document database is unavailable; try again later",
                              headers={"Retry-After": str(STORE_RETRY_AFTER)})
    if status in (502, 503):
        # What failed inside (a CUDA error, a remote server's URL) is for the log, not the client.
        log.error("generator failure: %s", exc)
        message = ("the answer generator is unavailable; try again later" if status == 503
                   else "the answer generator refused the request")
        return error_response(request, status, message, headers={"Retry-After": "5"} if status == 503 else None)
    if status == 500:
        # Internal errors may carry details: log them, answer with a generic message.
        log_exception(log, "internal error", exc)
        return error_response(request, 500, "internal error")
    return error_response(request, status, str(exc), headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RagError)
    async def _rag_error(request: Request, exc: RagError) -> JSONResponse:
        return rag_error_response(request, exc)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Path and query parameters (bodies are parsed by the routes, after the key is checked).
        error = validation_error(exc)
        return error_response(request, error.status, error.message, param=error.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such route (GET /openapi.json lists them)"  # the path is not quoted back
        return error_response(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        route = getattr(request.scope.get("route"), "path", None) or "an unmatched route"
        log_exception(log, f"unexpected error on {request.method} {route}", exc)
        return error_response(request, 500, "internal error")
