"""Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with the status each deserves."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag.error_log import log_exception
from rag.openai_wire import ApiError, error_body, validation_error

logger = logging.getLogger(__name__)

def error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure becomes an OpenAI-shaped JSON error; nothing answers with a traceback."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        if exc.status_code == 404:
            message = "no such route: this server has /v1/models, /v1/completions and /v1/chat/completions"
        return error_response(ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # A bug: log it here, answer with nothing the client could learn internals from.
        route = getattr(request.scope.get("route"), "path", None) or "an unmatched route"
        log_exception(logger, f"internal error on {request.method} {route}", exc)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)
