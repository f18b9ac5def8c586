"""Map the RagError tree to HTTP status codes (the only place that does).

Two error shapes: the OpenAI routes (`/v1/chat/completions`, `/v1/models`, `/v1/documents`, any
other `/v1/...` path but `/v1/query`) answer `{"error": {"message", "type", "param", "code"}}`, which
the `openai` client and chat front ends parse; the query API answers `{"error": "message"}`.
A message never carries text the caller may not read: internal errors are logged and answered
with a generic message.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
)
from rag.openai_wire import ApiError, error_body

log = logging.getLogger(__name__)

# Most specific first.
_STATUS = [
    (AuthenticationError, 401),
    (PermissionDenied, 403),
    (NotFoundError, 404),
    (ConfigError, 422),
    (OverloadedError, 429),
    (GeneratorUnavailable, 503),
    (DeadlineExceeded, 504),
    (GenerationError, 502),
]

def status_for(error: RagError) -> int:
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return 500


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") and not path.startswith("/v1/query")


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if is_openai_path(request.url.path):
        # The OpenAI routes take invalid input as 400 (the client's BadRequestError), not 422.
        status = 400 if status == 422 else status
        body = error_body(status, message, param, code)
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def rag_error_response(request: Request, exc: RagError) -> JSONResponse:
    status = status_for(exc)
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status == 429:
        headers = {"Retry-After": str(int(getattr(exc, "retry_after", 1)))}
    if status in (502, 503):
        # What failed inside (a CUDA error, a remote server's URL) is for the log, not the client.
        log.error("generator failure: %s", exc)
        message = ("the answer generator is unavailable; try again later" if status == 503
                   else "the answer generator refused the request")
        return error_response(request, status, message, headers={"Retry-After": "5"} if status == 503 else None)
    if status == 500:
        # Internal errors may carry details: log them, answer with a generic message.
        log.error("internal error: %s", exc, exc_info=exc)
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
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(request, 422, message, param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error on %s: %s", request.url.path, exc, exc_info=exc)
        return error_response(request, 500, "internal error")
