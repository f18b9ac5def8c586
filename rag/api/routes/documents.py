"""GET /v1/documents/{collection}/{chunk_id}: the text a citation points at, for its reader only.

Whatever the caller may not read is a 404 with the same body as an id that does not exist.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from rag.api.deps import PrincipalDep, RagDep
from rag.api.error_docs import KEYED, error_responses
from rag.api.errors import ApiError
from rag.citations import shown_source

router = APIRouter(prefix="/v1")

_NOT_FOUND = "no such document"


@router.get("/documents/{collection}/{chunk_id}", summary="The text a citation points at, for its reader only",
            responses=error_responses(*KEYED, 404))
async def get_document(collection: str, chunk_id: str, rag: RagDep, principal: PrincipalDep) -> dict:
    if not (chunk_id.isascii() and chunk_id.isdigit()) or len(chunk_id) > 20:  # "²".isdigit(), but int() refuses it
        raise ApiError(404, _NOT_FOUND)
    record = await asyncio.to_thread(rag.readable_chunk, collection, int(chunk_id), principal)
    if record is None:
        raise ApiError(404, _NOT_FOUND)
    name = shown_source(record.source)
    return {"object": "document.chunk", "id": record.id, "collection": collection, "document": name,
            "source": name, "title": record.title, "chunk": record.index, "heading": record.heading,
            "text": record.text}
