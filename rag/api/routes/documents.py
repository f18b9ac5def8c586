"""GET /v1/documents/{collection}/{chunk_id}: the text a citation points at, for its reader only.

A source read with its page's second chunk (retrieval.second_chunks) is cited as `{id}+{id2}`:
the two chunks of one document, joined as the answer read them. Whatever the caller may not
read (either chunk), and a pair from two documents, is a 404 with the same body as an id that
does not exist.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from rag.api.deps import PrincipalDep, RagDep
from rag.api.error_docs import KEYED, error_responses
from rag.api.errors import ApiError
from rag.citations import shown_source
from retrieval.second_chunks import join_texts

router = APIRouter(prefix="/v1")

_NOT_FOUND = "no such document"


@router.get("/documents/{collection}/{chunk_id}", summary="The text a citation points at, for its reader only",
            responses=error_responses(*KEYED, 404))
async def get_document(collection: str, chunk_id: str, rag: RagDep, principal: PrincipalDep) -> dict:
    ids = chunk_id.split("+")
    # "²".isdigit(), but int() refuses it
    if len(ids) > 2 or not all(i.isascii() and i.isdigit() and len(i) <= 20 for i in ids):
        raise ApiError(404, _NOT_FOUND)
    records = await asyncio.to_thread(rag.readable_chunks, collection, [int(i) for i in ids], principal)
    if any(r is None for r in records):
        raise ApiError(404, _NOT_FOUND)
    record, text, joined = records[0], records[0].text, None
    if len(records) == 2:
        second = records[1]
        if second.document_key != record.document_key or second.id == record.id:
            raise ApiError(404, _NOT_FOUND)
        first, later = sorted(records, key=lambda r: r.index)
        text, joined = join_texts(first.text, later.text), second.id
    name = shown_source(record.source)
    out = {"object": "document.chunk", "id": record.id, "collection": collection, "document": name,
           "source": name, "title": record.title, "chunk": record.index, "heading": record.heading,
           "text": text}
    if joined is not None:
        out["joined_chunk"] = joined
    return out
