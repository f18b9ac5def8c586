"""GET /healthz (the process is up) and GET /readyz (a query started now can be answered)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rag.api.deps import CallerDep, RagDep
from rag.api.error_docs import KEYED, error_responses
from rag.api.errors import ApiError
from rag.api.schemas import Health, Ready
from rag.errors import RagError

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/healthz", response_model=Health)
async def healthz(rag: RagDep) -> Health:
    # No key here: say nothing about the data (collection names can tell what a group works on;
    # GET /v1/models lists what a key may read).
    return Health(status="ok")


@router.get("/readyz", responses={200: {"model": Ready, "description": "Ready to answer"},
                                  503: {"model": Ready,
                                        "description": "Not ready: the generator or the database is not answering"}})
async def readyz(rag: RagDep) -> JSONResponse:
    generator = rag.__dict__.get("generator")
    admission = rag.admission.snapshot()
    # An extracting service never loads a generator: say so, rather than "not loaded", which reads
    # like something still to come (or gone wrong).
    idle = "not needed (answers are extracted)" if rag.answer_mode == "extract" else "not loaded"
    body = {"ready": True, "generator": idle, "in_flight": admission.in_flight, "queued": admission.queued}
    if generator is not None:
        body["generator"] = generator.model_name
        check = getattr(generator, "check_ready", None)
        ready = await check() if check is not None else generator.is_ready()
        if not ready:
            body.update(ready=False, detail="the generator is not running or not answering")
    if rag.stores.is_pgvector:
        # Every query reads PostgreSQL: asked afresh each time, so readiness comes back with the server.
        try:
            problem = await asyncio.to_thread(rag.stores.unavailable)
        except RagError as e:  # no server configured
            problem = str(e)
        body["database"] = "ok" if problem is None else "not answering"
        if problem is not None:
            # The route takes no key, so the body names no host or port (the 503s of /v1 routes do
            # not either): the log, which only the operator reads, has the server's address.
            log.warning("not ready: %s", problem)
            detail = "the database is not answering (the server's log names it)"
            body.update(ready=False, detail=f"{body['detail']}; {detail}" if body.get("detail") else detail)
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/metrics/engine", responses=error_responses(*KEYED, 404))
async def engine_metrics(rag: RagDep, caller: CallerDep) -> dict:
    """The generator's counters, the admission queue and the micro-batchers' batch sizes: to admin
    keys, and to every key where expose_engine_metrics is on (cache counters move with other users'
    requests)."""
    if not (rag.settings.expose_engine_metrics or caller.is_admin):
        raise ApiError(404, "no such route (GET /openapi.json lists them)")
    generator = rag.__dict__.get("generator")
    metrics = getattr(generator, "metrics", None)
    out: dict = {"admission": dataclasses.asdict(rag.admission.snapshot())}
    if metrics is not None:
        out["engine"] = dataclasses.asdict(metrics())
    for name in ("query_embedder", "batched_reranker"):
        batcher = rag.__dict__.get(name)
        if batcher is not None:
            out[name] = dataclasses.asdict(batcher.batcher.stats)
    return out
