"""Request ids, access logs and Prometheus metrics of the query service (`GET /metrics`).

Nothing here carries question, answer or document text, user names or collection names: routes
are labelled by their template (`/v1/documents/{collection}/{chunk_id}`, never the path), and the
engine's cache counters are exported only as totals across everyone. `/metrics` takes no key, so
operators should not expose it beyond their monitoring network (`metrics_enabled = false` turns it off).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rag.api.errors import error_response
from rag.api.logs import request_id_var
from rag.engine_prometheus import engine_metric_families
from rag.error_log import log_exception

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from rag.answering import AnswerDone
    from rag.settings import Settings

access_log = logging.getLogger("rag.access")
error_log = logging.getLogger("rag.api.errors")

REQUEST_ID_HEADER = "X-Request-ID"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Anything else becomes "other", so that a client cannot mint label values.
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
UNMATCHED_ROUTE = "unmatched"
# Retrieval takes milliseconds, a long answer minutes (the request deadline defaults to 300 s).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def valid_request_id(value: str | None) -> str | None:
    """The client's X-Request-ID when it is safe to log and echo (<= 128 of [A-Za-z0-9._-]), else None."""
    return value if value is not None and _VALID_REQUEST_ID.fullmatch(value) else None


class Metrics:
    """The app's own registry (two apps in one process do not share counters)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("rag_requests", "HTTP requests by route template, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_duration = Histogram("rag_http_request_duration_seconds",
                                          "HTTP request time until the last byte, by route template",
                                          ["route", "method"], buckets=_BUCKETS, registry=r)
        # One observation per finished answer (query and chat routes), from Answer.timings.
        self.answer_seconds = {
            "queue": Histogram("rag_request_queue_seconds", "wait for a generation slot", buckets=_BUCKETS, registry=r),
            "embed": Histogram("rag_retrieval_embed_seconds", "query embedding", buckets=_BUCKETS, registry=r),
            "search": Histogram("rag_retrieval_search_seconds", "vector search", buckets=_BUCKETS, registry=r),
            "keyword": Histogram("rag_retrieval_keyword_seconds", "keyword search", buckets=_BUCKETS, registry=r),
            "fetch": Histogram("rag_retrieval_fetch_seconds", "fetching hit text and ACL post-check",
                               buckets=_BUCKETS, registry=r),
            "rerank": Histogram("rag_retrieval_rerank_seconds", "cross-encoder reranking", buckets=_BUCKETS,
                                registry=r),
            "ttft": Histogram("rag_time_to_first_token_seconds", "from the generation slot to the first token",
                              buckets=_BUCKETS, registry=r),
            "generate": Histogram("rag_generation_seconds", "generation, from the slot to the last token",
                                  buckets=_BUCKETS, registry=r),
            "total": Histogram("rag_request_seconds", "one answer, retrieval to last token", buckets=_BUCKETS,
                               registry=r),
        }
        self.prompt_tokens = Counter("rag_prompt_tokens", "prompt tokens of finished answers", registry=r)
        self.generated_tokens = Counter("rag_generated_tokens", "tokens generated for finished answers", registry=r)
        self.answers = Counter("rag_answers", "finished answers by finish reason", ["finish_reason"], registry=r)

    def record_answer(self, done: AnswerDone) -> None:
        for key, seconds in done.answer.timings.items():
            histogram = self.answer_seconds.get(key)
            if histogram is not None:
                histogram.observe(seconds)
        self.prompt_tokens.inc(done.usage.prompt_tokens)
        self.generated_tokens.inc(done.usage.completion_tokens)
        reason = done.finish_reason if done.finish_reason in ("stop", "length", "abort") else "other"
        self.answers.labels(reason).inc()


class _StateCollector(Collector):
    """Read at scrape time: the admission queue, and the local engine's counters once it is loaded."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator:
        rag = getattr(self.app.state, "rag", None)
        if rag is None:  # before the lifespan has built it
            return
        a = rag.admission.snapshot()
        yield GaugeMetricFamily("rag_admission_in_flight", "answers holding a generation slot", value=a.in_flight)
        yield GaugeMetricFamily("rag_admission_queued", "answers waiting for a generation slot", value=a.queued)
        yield GaugeMetricFamily("rag_admission_max_in_flight", "generation slots", value=a.max_in_flight)
        yield GaugeMetricFamily("rag_admission_max_queued", "queue places before 429", value=a.max_queued)
        yield CounterMetricFamily("rag_admission_admitted", "answers given a generation slot", value=a.num_admitted)
        yield CounterMetricFamily("rag_admission_rejections", "answers refused with 429 (queue full)",
                                  value=a.num_rejected)
        generator = rag.__dict__.get("generator")  # never load it from a scrape
        metrics = getattr(generator, "metrics", None)
        if metrics is None:  # not loaded yet, or a remote generator (scrape that server instead)
            return
        yield from engine_metric_families(metrics())


class ObservabilityMiddleware:
    """Request id in, request id out (errors too), one access-log line and the request counters.

    Plain ASGI rather than BaseHTTPMiddleware, so that streamed answers pass through untouched and
    the duration runs to the last byte.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = valid_request_id(given) or uuid.uuid4().hex
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # Handled here, not re-raised: past this point Starlette and uvicorn would log the
            # exception with its message, which can quote the request (a question, a document's
            # text). The log gets its type and stack only; the client a generic 500 with our header.
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            log_exception(error_log, f"unexpected error on {scope['method']} {route}", exc)
            if not response_started:
                await error_response(Request(scope), 500, "internal error")(scope, receive, send_with_id)
        finally:
            duration = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.request_duration.labels(route, method).observe(duration)
            access_log.info("%s %s %d %.1f ms", method, route, status, duration * 1000,
                            extra={"method": method, "route": route, "status": status,
                                   "duration_ms": round(duration * 1000, 1)})
            request_id_var.reset(token)


def install_observability(app: FastAPI, settings: Settings) -> Metrics:
    """Request ids and access logs on every route; `GET /metrics` unless settings.metrics_enabled is off."""
    metrics = Metrics()
    metrics.registry.register(_StateCollector(app))
    app.state.metrics = metrics
    app.add_middleware(ObservabilityMiddleware, metrics=metrics)
    if settings.metrics_enabled:
        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return metrics


def record_answer(request: Request, done: AnswerDone) -> None:
    """Called by the answering routes when an answer is complete: its timings and token counts."""
    metrics: Metrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.record_answer(done)
