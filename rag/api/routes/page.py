"""The built-in chat page: GET / (index.html) and GET /static/NAME (its script and style sheet).

Only the files shipped in `rag/api/static` are served, looked up by exact name in a fixed table:
a name with `..`, a slash (encoded or not), a backslash or anything else not in the table is a
404 like any unknown path. Every answer carries a Content-Security-Policy that allows nothing but
this origin (no inline script, no other hosts), so text from the server can only ever be text.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from rag.api.errors import ApiError

router = APIRouter(include_in_schema=False)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
          ".ico": "image/x-icon"}

# Fixed at import: the names that exist, nothing built from the request ever reaches the file system.
_FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file() and p.suffix in _TYPES} \
    if STATIC_DIR.is_dir() else {}

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def _serve(name: str) -> Response:
    path = _FILES.get(name)
    if path is None:
        raise ApiError(404, "no such file")
    return Response(path.read_bytes(), media_type=_TYPES[path.suffix], headers=_HEADERS)


@router.get("/")
async def index() -> Response:
    return _serve("index.html")


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    return _serve(name)
