"""OpenAI-compatible chat for front ends: GET /v1/models, POST /v1/chat/completions.

A model id is a collection the key may read from. Answers come from that collection's documents
the key's principal may read, with citations where front ends and proxies look for them:
`message.annotations` / `delta.annotations` (OpenAI's url_citation entries, plus the cited text)
and, when not streaming, a top-level `citations` list. Stage timings (`timings_ms`, not part of
OpenAI's shape) are added for admin keys only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rag.answering import AnswerDone
from rag.api.deps import AuditedCallerDep, PrincipalDep, RagDep, json_body_schema, read_json
from rag.api.error_docs import KEYED, QUESTION, error_responses
from rag.api.errors import ApiError, rag_error_response
from rag.api.observability import record_answer
from rag.api.openai_schemas import ChatCompletionRequest
from rag.api.routes.query import prepare_with_deadline
from rag.api.streaming import EventStream, after_admission, sse, until_disconnected
from rag.audit import audit_event, audited_stream
from rag.citations import marker_spans, shown_source
from rag.conversation import parse_conversation
from rag.errors import RagError
from rag.generator import GenerationParams, TextDelta
from rag.types import Answer

router = APIRouter(prefix="/v1")


@router.get("/models", summary="The collections this key may ask (OpenAI model ids)",
            responses=error_responses(*KEYED))
async def list_models(rag: RagDep, principal: PrincipalDep) -> dict:
    names = await asyncio.to_thread(rag.readable_collections, principal)
    created = int(time.time())
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": "labrag"} for n in names]}


@router.post("/chat/completions", summary="Answer a chat from a collection, with citations (OpenAI-compatible)",
             openapi_extra=json_body_schema(ChatCompletionRequest), responses=error_responses(*QUESTION))
async def chat_completions(request: Request, rag: RagDep, caller: AuditedCallerDep):
    body = await read_json(request, rag, ChatCompletionRequest)  # after the key: no body is read for a 401
    principal = caller.principal
    conversation = parse_conversation([m.model_dump() for m in body.messages])
    if not await asyncio.to_thread(rag.can_read_collection, body.model, principal):
        # The same answer for a collection that does not exist and one this key cannot read (and
        # the name is not quoted back).
        raise ApiError(404, "the model does not exist: GET /v1/models lists those this key may use",
                       param="model", code="model_not_found")
    deadline = time.monotonic() + rag.settings.request_timeout
    rag.admission.check()  # a full queue is refused before retrieval spends any work on it
    prepared = await prepare_with_deadline(rag, deadline, question=conversation.question, principal=principal,
                                           collection=body.model, history=conversation.history,
                                           retrieval_query=conversation.retrieval_query)
    if prepared.request is not None:
        defaults = prepared.request.params
        params = GenerationParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or defaults.max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            stop=tuple(body.stop or ()), seed=body.seed)
        prepared.request = dataclasses.replace(prepared.request, params=params)
    events = until_disconnected(request, rag.answer_events(prepared, deadline))
    reply = _Reply(body.model, _document_url(request, body.model), with_timings=caller.is_admin,
                   answer_mode=rag.answer_mode)
    if not body.stream:
        done = None
        async for event in events:
            if isinstance(event, AnswerDone):
                done = event
                record_answer(request, event)
        assert done is not None
        await audit_event(request, done.answer)
        return JSONResponse(reply.completion(done))
    first = await anext(events, None)  # a generation slot first: a full queue is a real 429
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(audited_stream(request, prepared.answer, _chunks(request, reply, first, events, include_usage)))


def _document_url(request: Request, collection: str):
    """chunk id (and a joined second chunk's) -> the URL that gives exactly the cited text."""
    base = str(request.base_url).rstrip("/")
    return lambda chunk_id, joined=None: (f"{base}/v1/documents/{collection}/{chunk_id}"
                                          + (f"+{joined}" if joined is not None else ""))


class _Reply:
    """The fixed parts of one completion's JSON: id, timestamps, model, citation entries."""

    def __init__(self, model: str, url_for, with_timings: bool = False, answer_mode: str | None = None) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.url_for = url_for
        self.with_timings = with_timings  # admin keys only (see rag/api/routes/query.py)
        # "extract" or "generate": a top-level extension field beside `citations` (clients ignore it).
        self.answer_mode = answer_mode

    def annotations(self, answer: Answer) -> list[dict]:
        spans = marker_spans(answer.text or "", [c.number for c in answer.citations])
        out = []
        for c, hit in zip(answer.citations, _hits_by_citation(answer), strict=True):
            start, end = spans.get(c.number, (0, 0))
            out.append({"type": "url_citation", "url_citation": {
                "url": self.url_for(hit.chunk_id, c.joined_chunk_id), "title": f"[{c.number}] {_title(hit)}",
                "start_index": start, "end_index": end, "number": c.number, "text": c.text,
                "source": shown_source(c.source), "document": shown_source(c.source),
                "chunk": c.chunk_index, "relevance": c.relevance}})
        return out

    def citations(self, answer: Answer) -> list[dict]:
        return [{"number": c.number, "title": _title(h), "url": self.url_for(h.chunk_id, c.joined_chunk_id),
                 "text": c.text,
                 "source": shown_source(c.source), "document": shown_source(c.source), "chunk": c.chunk_index,
                 "score": c.score, "relevance": c.relevance}
                for c, h in zip(answer.citations, _hits_by_citation(answer), strict=True)]

    def completion(self, done: AnswerDone) -> dict:
        answer = done.answer
        completion = {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "finish_reason": done.finish_reason, "logprobs": None,
                         "message": {"role": "assistant", "content": answer.text or "",
                                     "annotations": self.annotations(answer)}}],
            "usage": _usage(done),
            "citations": self.citations(answer),
        }
        if self.answer_mode is not None:
            completion["answer_mode"] = self.answer_mode
        if self.with_timings:
            completion["timings_ms"] = {k: round(v * 1000, 1) for k, v in answer.timings.items()}
        return completion

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
                    **extra})


async def _chunks(request: Request, reply: _Reply, first, events: AsyncIterator, include_usage: bool):
    yield reply.chunk({"role": "assistant", "content": ""})
    try:
        async for event in after_admission(first, events):
            if isinstance(event, TextDelta):
                yield reply.chunk({"content": event.text})
            elif isinstance(event, AnswerDone):
                record_answer(request, event)
                yield reply.chunk({"annotations": reply.annotations(event.answer)})
                yield reply.chunk({}, event.finish_reason)
                if include_usage:
                    yield sse({"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                               "model": reply.model, "choices": [], "usage": _usage(event)})
    except RagError as exc:
        # Headers are sent: the error goes in the stream, where the openai client raises it.
        response = rag_error_response(request, exc)
        yield sse(response.body.decode())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


def _usage(done: AnswerDone) -> dict:
    u = done.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.total_tokens}
    if u.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return usage


def _hits_by_citation(answer: Answer):
    by_key = {(h.document_key, h.chunk_index): h for h in answer.hits}
    return [by_key[(c.document_key, c.chunk_index)] for c in answer.citations]


def _title(hit) -> str:
    return hit.title or shown_source(hit.source)
