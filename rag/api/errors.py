"""Map the RagError tree to HTTP status codes (the only place that does)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rag.errors import (
    AuthenticationError,
    ConfigError,
    NotFoundError,
    PermissionDenied,
    RagError,
)

log = logging.getLogger(__name__)

_STATUS = [
    (AuthenticationError, 401),
    (PermissionDenied, 403),
    (NotFoundError, 404),
    (ConfigError, 422),
]


def status_for(error: RagError) -> int:
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return 500


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RagError)
    async def _rag_error(request: Request, exc: RagError) -> JSONResponse:
        status = status_for(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status == 500:
            # Internal errors may carry details: log them, answer with a generic message.
            log.exception("internal error", exc_info=exc)
            return JSONResponse({"error": "internal error"}, status_code=500)
        return JSONResponse({"error": str(exc)}, status_code=status, headers=headers)
