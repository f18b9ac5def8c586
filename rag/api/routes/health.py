"""GET /healthz: is the service up, and which collections does it have."""

from __future__ import annotations

from fastapi import APIRouter

from rag.api.deps import RagDep
from rag.api.schemas import Health

router = APIRouter()


@router.get("/healthz", response_model=Health)
def healthz(rag: RagDep) -> Health:
    return Health(status="ok", collections=rag.collection_names())
