"""POST /v1/query: answer a question from what the key's principal may read."""

from __future__ import annotations

from fastapi import APIRouter

from rag.api.deps import PrincipalDep, RagDep
from rag.api.schemas import CitationOut, QueryRequest, QueryResponse

router = APIRouter(prefix="/v1")


@router.post("/query", response_model=QueryResponse)
def query(body: QueryRequest, rag: RagDep, principal: PrincipalDep) -> QueryResponse:
    # A plain `def`: FastAPI runs it in a worker thread, so model inference doesn't block
    # the event loop.
    answer = rag.query(body.question, principal, collection=body.collection, k=body.k,
                       generate=body.generate, mode=body.mode)
    return QueryResponse(
        question=answer.question,
        user=principal.user,
        answer=answer.text,
        citations=[
            CitationOut(number=c.number, document=c.document_key, source=c.source,
                        chunk=c.chunk_index, score=c.score, text=c.text)
            for c in answer.citations
        ],
        timings_ms={k: round(v * 1000, 1) for k, v in answer.timings.items()},
    )
