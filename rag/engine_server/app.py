"""App factory: `create_engine_app(engine, model_name, api_key)` serves one AsyncLLMEngine over the OpenAI API."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from generation.engine.async_engine import AsyncLLMEngine
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams
from rag.engine_server.errors import ApiError, error_body, install_error_handlers
from rag.engine_server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from rag.engine_server.streaming import DONE, ClientDisconnected, EventStream, sse, unless_disconnected
from rag.errors import GenerationError
from rag.openai_wire import parse_json_body, read_body

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class _Job:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    namespace: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


class _Server:
    """The engine and what every route needs to know about it."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, api_key: str | None, max_body_bytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.model_config.vocab_size

    # --- checks -----------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._key):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer KEY`",
                           code="invalid_api_key")

    def check_running(self) -> None:
        if not self.engine.is_running:
            raise ApiError(503, "the generation engine is not running; restart the server", code="engine_dead")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            # The name asked for is not quoted back (no request text in answers).
            raise ApiError(404, f"no such model: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def read(self, request: Request, schema: type[Body]) -> Body:
        """The JSON body as `schema` (called after the key check); every way it can be malformed is a 4xx.

        Never reads past max_body_bytes: a declared length over it is refused unread, a chunked
        body as soon as it passes it (413).
        """
        return parse_json_body(await read_body(request, self.max_body_bytes), schema, self.max_body_bytes)

    # --- prompts ----------------------------------------------------------------------------------

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions with a formatted prompt",
                           param="messages")
        try:
            ids: Any = tokenizer.apply_chat_template(
                body.chat_messages(), add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception:  # noqa: BLE001 - jinja templates raise what they like (role order, ...)
            # Not the template's message: it may quote the messages back.
            raise ApiError(400, "the model's chat template refused these messages (check the order of roles: "
                           "one system message first, then user and assistant turns)", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers versions differ
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            return [int(t) for t in self.tokenizer(prompt).input_ids]
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def job(self, body: SamplingFields, prompt_ids: list[int], wanted: int | None, what: str) -> _Job:
        """Check lengths against the context and build the engine's SamplingParams."""
        n, limit = len(prompt_ids), self.max_model_len
        if n == 0:
            raise ApiError(400, "the prompt is empty", param=what)
        if n >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the {what} take {n}: "
                           "shorten them", param=what, code="context_length_exceeded")
        room = limit - n
        if wanted is not None and not 1 <= wanted <= room:
            raise ApiError(400, f"max_tokens must be in [1, {room}] for this prompt ({n} tokens of a {limit}-token "
                           f"context), got {wanted}", param="max_tokens")
        if body.stop and self.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer, and this model has none", param="stop")
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    max_tokens=wanted or room, stop=list(body.stop or []),
                                    ignore_eos=body.ignore_eos, seed=body.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return _Job(prompt_ids, params, body.cache_salt, body.stream, body.include_usage, body.return_token_ids)

    # --- generation -------------------------------------------------------------------------------

    def updates(self, job: _Job):
        return self.engine.generate_updates(job.prompt_ids, job.params, job.namespace)

    async def collect(self, job: _Job) -> RequestOutput:
        async with contextlib.aclosing(self.updates(job)) as updates:
            async for update in updates:
                if update.finished:
                    assert update.output is not None
                    return update.output
        raise GenerationError("the engine ended the request without an output")

    def engine_error(self, e: GenerationError) -> ApiError:
        # A request the engine refuses is the client's fault; a stopped engine is ours.
        if not self.engine.is_running:
            return ApiError(503, "the generation engine is not running; restart the server", code="engine_dead")
        return ApiError(400, str(e))


def _authorized(request: Request) -> _Server:
    server: _Server = request.app.state.server
    server.check_key(request)
    return server


Srv = Annotated[_Server, Depends(_authorized)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_engine_app(
    engine: AsyncLLMEngine,
    model_name: str,
    api_key: str | None = None,
    *,
    owns_engine: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An OpenAI-compatible server over one engine, the way `vllm serve` is used on a GPU node.

    Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming or not),
    GET /health (503 once the engine has stopped), GET /metrics/engine (the engine's counters
    as JSON: num_running, num_kv_blocks_used, prefix_cache_hit_tokens, ...) and GET /metrics (the
    same counters and a TTFT histogram in Prometheus text, for scrapers and autoscalers; no key,
    as vLLM's: totals over every request only, so keep it on the monitoring network).

    A request's `cache_salt` is its prefix-cache namespace: only requests with the same salt share
    KV blocks, so a tenant cannot probe another's cached prompts by timing. A salt is only as good
    as the trust in whoever sets it: any holder of the API key may send any salt, so give the key
    only to a trusted front end (the RAG service) that derives salts itself and never passes one
    chosen by its own users.

    Args:
        engine: the running engine to serve.
        model_name: the model id clients name (others get 404).
        api_key: when set, /v1/* and /metrics/engine need `Authorization: Bearer KEY` (else 401).
        owns_engine: shut the engine down when the app stops.
        max_body_bytes: larger request bodies get 413.
    """
    server = _Server(engine, model_name, api_key, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owns_engine:
                engine.shutdown()

    app = FastAPI(title="labrag engine server", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the generation engine is not running"), status_code=503)
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics/engine")
    async def engine_metrics(srv: Srv) -> dict[str, Any]:
        return {"is_running": engine.is_running, **dataclasses.asdict(engine.get_metrics())}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # Imported here: the server runs where prometheus_client is missing, only /metrics does not.
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(_metrics_registry(engine)), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "labrag",
                "max_model_len": server.max_model_len}

    @v1.get("/models")
    async def list_models(srv: Srv) -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def get_model(model: str, srv: Srv) -> dict[str, Any]:
        srv.check_model(model)
        return model_card()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, srv: Srv) -> Response:
        body = await srv.read(request, ChatCompletionRequest)
        srv.check_model(body.model)
        srv.check_running()
        job = srv.job(body, srv.chat_prompt(body), body.wanted_tokens, "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if job.stream:
            return EventStream(_chat_events(srv, job, head))
        output = await _answer(request, srv, job)
        if output is None:
            return Response(status_code=499)
        message = {"role": "assistant", "content": output.text}
        return JSONResponse({**head, "object": "chat.completion",
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": output.finish_reason, **_ids(job, output.token_ids)}],
                             "usage": _usage(output.num_prompt_tokens, output.num_output_tokens)})

    @v1.post("/completions")
    async def completions(request: Request, srv: Srv) -> Response:
        body = await srv.read(request, CompletionRequest)
        srv.check_model(body.model)
        srv.check_running()
        job = srv.job(body, srv.completion_prompt(body), body.max_tokens, "prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        if job.stream:
            return EventStream(_completion_events(srv, job, head))
        output = await _answer(request, srv, job)
        if output is None:
            return Response(status_code=499)
        return JSONResponse({**head, "object": "text_completion",
                             "choices": [{"index": 0, "text": output.text, "logprobs": None,
                                          "finish_reason": output.finish_reason, **_ids(job, output.token_ids)}],
                             "usage": _usage(output.num_prompt_tokens, output.num_output_tokens)})

    app.include_router(v1)
    return app


async def _answer(request: Request, srv: _Server, job: _Job) -> RequestOutput | None:
    """The whole output, or None when the client left first (its engine request is aborted)."""
    try:
        return await unless_disconnected(request, srv.collect(job))
    except ClientDisconnected:
        return None
    except GenerationError as e:
        raise srv.engine_error(e) from None


def _ids(job: _Job, token_ids: list[int]) -> dict[str, list[int]]:
    return {"token_ids": list(token_ids)} if job.return_token_ids else {}


def _metrics_registry(engine: AsyncLLMEngine):
    """A registry that reads the engine's counters when scraped."""
    from prometheus_client import CollectorRegistry

    from rag.engine_prometheus import engine_metric_families

    class _Collector:
        def collect(self):
            return engine_metric_families(engine.get_metrics())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return registry


@dataclass(frozen=True)
class _Delta:
    """One step's new text and the token ids behind it."""

    text: str
    token_ids: list[int]


async def _chat_events(srv: _Server, job: _Job, head: dict[str, Any]) -> AsyncIterator[str]:
    def chunk(delta: dict[str, str], finish_reason: str | None = None, ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if ids is not None:
            choice.update(_ids(job, ids))
        return {**head, "object": "chat.completion.chunk", "choices": [choice]}

    yield sse(chunk({"role": "assistant", "content": ""}))
    # aclosing at every level: a closed stream must close the engine request's generator now.
    async with contextlib.aclosing(_pieces(srv, job)) as pieces:
        async for piece in pieces:
            if isinstance(piece, _Delta):
                yield sse(chunk({"content": piece.text}, ids=piece.token_ids))
            elif isinstance(piece, RequestOutput):
                yield sse(chunk({}, piece.finish_reason))
                if job.include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": _usage(piece.num_prompt_tokens, piece.num_output_tokens)})
            else:
                yield sse(piece)
    yield DONE


async def _completion_events(srv: _Server, job: _Job, head: dict[str, Any]) -> AsyncIterator[str]:
    def chunk(text: str, finish_reason: str | None = None, ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if ids is not None:
            choice.update(_ids(job, ids))
        return {**head, "object": "text_completion", "choices": [choice]}

    async with contextlib.aclosing(_pieces(srv, job)) as pieces:
        async for piece in pieces:
            if isinstance(piece, _Delta):
                yield sse(chunk(piece.text, ids=piece.token_ids))
            elif isinstance(piece, RequestOutput):
                yield sse(chunk("", piece.finish_reason))
                if job.include_usage:
                    yield sse({**head, "object": "text_completion", "choices": [],
                               "usage": _usage(piece.num_prompt_tokens, piece.num_output_tokens)})
            else:
                yield sse(piece)
    yield DONE


async def _pieces(srv: _Server, job: _Job) -> AsyncIterator[_Delta | RequestOutput | dict[str, Any]]:
    """Text deltas (with return_token_ids: every step's new tokens, text or not), then the output;
    an error body instead if the engine fails mid-stream.

    Headers are sent by then, so an error can only be an event (vLLM does the same).
    """
    try:
        async with contextlib.aclosing(srv.updates(job)) as updates:
            async for update in updates:
                if update.text_delta or (job.return_token_ids and update.new_token_ids):
                    yield _Delta(update.text_delta, list(update.new_token_ids))
                if update.finished:
                    assert update.output is not None
                    yield update.output
                    return
    except GenerationError as e:
        error = srv.engine_error(e)
        yield error_body(error.status, error.message, code=error.code)
