"""POST /v1/query: answer a question from what the key's principal may read (JSON, or SSE with stream: true).

Stage timings (`timings_ms`) go to admin keys only: other callers get null (JSON) or no field
(the stream's done event), since the keyword leg's time depends on unreadable chunks too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from rag.answering import AnswerDone
from rag.api.deps import AuditedCallerDep, Caller, RagDep, json_body_schema, read_json
from rag.api.error_docs import QUESTION, error_responses
from rag.api.errors import rag_error_response
from rag.api.observability import record_answer
from rag.api.schemas import CitationOut, QueryRequest, QueryResponse
from rag.api.streaming import EventStream, after_admission, sse, until_disconnected
from rag.audit import audit_event, audited_stream
from rag.citations import shown_source
from rag.errors import DeadlineExceeded, NotFoundError, RagError
from rag.generator import TextDelta
from rag.types import Answer

router = APIRouter(prefix="/v1")


def citations_out(answer: Answer) -> list[CitationOut]:
    return [CitationOut(number=c.number, document=shown_source(c.source), source=shown_source(c.source),
                        chunk=c.chunk_index, score=c.score, text=c.text, relevance=c.relevance,
                        rank=c.rank) for c in answer.citations]


def timings_ms(answer: Answer, caller: Caller) -> dict[str, float] | None:
    """The answer's stage timings for an admin key; None for any other caller."""
    if not caller.is_admin:
        return None
    return {k: round(v * 1000, 1) for k, v in answer.timings.items()}


async def prepare_with_deadline(rag, deadline: float, **kwargs):
    try:
        async with asyncio.timeout(deadline - time.monotonic()):
            return await rag.aprepare(**kwargs)
    except TimeoutError as exc:
        raise DeadlineExceeded("retrieval took longer than the request deadline") from exc


@router.post("/query", response_model=QueryResponse, openapi_extra=json_body_schema(QueryRequest),
             summary="Answer a question from what the key may read, with citations (JSON or SSE)",
             responses=error_responses(*QUESTION))
async def query(rag: RagDep, caller: AuditedCallerDep, request: Request):
    body = await read_json(request, rag, QueryRequest)  # after the key: no body is read for a 401
    principal = caller.principal
    deadline = time.monotonic() + rag.settings.request_timeout
    rag.admission.check()  # a full queue is refused before retrieval spends any work on it
    if body.collection is not None and body.collection != rag.settings.collection:
        # A collection the key can read nothing in answers like one that does not exist (and the
        # store's own message, which lists every collection, never reaches the client).
        if not await asyncio.to_thread(rag.can_read_collection, body.collection, principal):
            raise NotFoundError("unknown collection: GET /v1/models lists those this key may read")
    prepared = await prepare_with_deadline(rag, deadline, question=body.question, principal=principal,
                                           collection=body.collection, k=body.k, generate=body.generate,
                                           mode=body.mode)
    events = until_disconnected(request, rag.answer_events(prepared, deadline))
    if not body.stream:
        done = None
        async for event in events:
            if isinstance(event, AnswerDone):
                done = event
                record_answer(request, event)
        answer = done.answer if done else prepared.answer
        await audit_event(request, answer)
        return QueryResponse(question=answer.question, user=principal.user, answer=answer.text,
                             answer_mode=rag.answer_mode if body.generate else None,
                             citations=citations_out(answer), timings_ms=timings_ms(answer, caller),
                             usage=_usage(done))
    # Wait for a generation slot before the headers go out: a full queue is a real 429.
    first = await anext(events, None)
    mode = rag.answer_mode if body.generate else None
    return EventStream(audited_stream(request, prepared.answer,
                                      _sse_body(request, prepared.answer, caller, first, events, mode)))


async def _sse_body(request: Request, answer: Answer, caller: Caller, first,
                    events: AsyncIterator, answer_mode: str | None) -> AsyncIterator[str]:
    yield sse({"type": "citations", "question": answer.question, "user": caller.principal.user,
               "citations": [c.model_dump() for c in citations_out(answer)]}, event="citations")
    try:
        async for event in after_admission(first, events):
            if isinstance(event, TextDelta):
                yield sse({"type": "delta", "text": event.text}, event="delta")
            elif isinstance(event, AnswerDone):
                record_answer(request, event)
                done = {"type": "done", "answer": event.answer.text, "answer_mode": answer_mode,
                        "finish_reason": event.finish_reason, "usage": _usage(event)}
                timings = timings_ms(event.answer, caller)
                if timings is not None:
                    done["timings_ms"] = timings
                yield sse(done, event="done")
    except RagError as exc:
        # The headers are gone: the error becomes the stream's last event, in the one error shape
        # (and with the same scrubbed message as a JSON answer would carry).
        response = rag_error_response(request, exc)
        body = json.loads(response.body)
        yield sse({"type": "error", "status": response.status_code, **body}, event="error")
    finally:
        await events.aclose()


def _usage(done: AnswerDone | None) -> dict[str, int] | None:
    if done is None or not done.usage.total_tokens:
        return None
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}
