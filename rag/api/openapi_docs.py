"""GET /docs: Swagger UI over /openapi.json, served from this process so it works offline.

FastAPI's own /docs and /redoc load their scripts from a CDN, which clusters without internet
cannot reach (the page stays blank). Here Swagger UI's files come from the `swagger-ui-bundle-v2`
wheel (Apache-2.0; its LICENSE is in the wheel's dist-info) and the page and its start-up script
from `rag/api/static/docs/`. Files are looked up by exact name in a fixed table, as the chat page's
are, and every answer carries a CSP that allows this origin only: no inline script, no other host
(Swagger UI's styles and its data: icons excepted). ReDoc is not served: one viewer is enough.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from rag.api.errors import ApiError

router = APIRouter(include_in_schema=False)

DOCS_DIR = Path(__file__).resolve().parent / "static" / "docs"

# Swagger UI sets inline styles and draws its icons from data: URLs; scripts stay 'self' only.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


@functools.cache
def _files() -> dict[str, Path]:
    """The names /docs serves. Swagger UI's two files, if its wheel is installed; our page and script."""
    files = {p.name: p for p in DOCS_DIR.iterdir() if p.is_file() and p.suffix in _TYPES} if DOCS_DIR.is_dir() else {}
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:  # answered by _serve with what to install
        return files
    for name in ("swagger-ui-bundle.js", "swagger-ui.css"):
        files[name] = Path(str(swagger_ui_path)) / name
    return files


def _serve(name: str) -> Response:
    path = _files().get(name)
    if path is None:
        if name.startswith("swagger-ui"):
            raise ApiError(404, "the API docs page needs the swagger-ui-bundle-v2 package (pip install "
                                "swagger-ui-bundle-v2); the schema itself is at /openapi.json")
        raise ApiError(404, "no such file")
    return Response(path.read_bytes(), media_type=_TYPES[path.suffix], headers=_HEADERS)


@router.get("/docs")
async def docs_page() -> Response:
    return _serve("index.html")


@router.get("/docs/{name}")
async def docs_file(name: str) -> Response:
    return _serve(name)
