"""Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) with the status each deserves."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered to the client as is (the message must not leak internals or secrets)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=headers)


def from_validation(exc: ValidationError | RequestValidationError) -> ApiError:
    """One 400 naming every bad field (`messages.0.role: Input should be ...`)."""
    errors = exc.errors()
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    first = errors[0].get("loc", ()) if errors else ()
    param = next((str(p) for p in first if p != "body"), None)
    return ApiError(400, "invalid request: " + "; ".join(parts), param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure becomes an OpenAI-shaped JSON error; nothing answers with a traceback."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        if exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}"
        return error_response(ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # A bug: log it here, answer with nothing the client could learn internals from.
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)
