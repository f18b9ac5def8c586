"""Request dependencies: the Rag of the app, and the caller behind the bearer key.

A user key stands for its own user and groups. A proxy key (`rag keys create --proxy`) stands
for a front end, which names its end user in one of `proxy_user_headers`; that user's groups
come from the directory (rules in permissions/proxy.py). The question routes take
`AuditedPrincipalDep`, which also writes the audit entry of a request that fails (rag/audit.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from permissions.models import Principal
from permissions.proxy import ProxyError, resolve_proxy_user
from rag.api.errors import is_openai_path, status_for
from rag.audit import RequestAudit, audit_event
from rag.errors import AuthenticationError, RagError
from rag.openai_wire import ApiError
from rag.pipeline import Rag

_bearer = HTTPBearer(auto_error=False)


@dataclass(frozen=True)
class Caller:
    """Who is asking (`principal`), through which key (`key_id`), and whether a front end named them."""

    principal: Principal
    key_id: str
    via_proxy: bool = False


def get_rag(request: Request) -> Rag:
    return request.app.state.rag


def resolve_caller(rag: Rag, request: Request, credentials: HTTPAuthorizationCredentials | None) -> Caller:
    """The caller of a request.

    Raises:
        AuthenticationError: a missing, malformed, unknown or revoked key (401).
        ApiError: a proxy key's request without a user header or naming an unknown user (403), or
            with a malformed one (400).
    """
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise AuthenticationError("invalid or missing API key")
    key = rag.identity.authenticate_key(credentials.credentials)
    if key.principal is not None:
        return Caller(key.principal, key.key_id)  # a user key: user headers change nothing
    audit: RequestAudit | None = getattr(request.state, "audit", None)
    if audit is not None:
        audit.key_id, audit.via_proxy = key.key_id, True
    try:
        principal = resolve_proxy_user(request.headers, rag.settings.proxy_user_headers, rag.identity.registered)
    except ProxyError as exc:
        raise ApiError(exc.status, str(exc), code=exc.code) from None
    return Caller(principal, key.key_id, via_proxy=True)


def get_caller(
    request: Request,
    rag: Annotated[Rag, Depends(get_rag)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    return resolve_caller(rag, request, credentials)


def get_principal(caller: Annotated[Caller, Depends(get_caller)]) -> Principal:
    """401 (via AuthenticationError) for a missing, malformed, unknown or revoked key; 400/403 for a
    proxy key's bad user header."""
    return caller.principal


async def get_audited_principal(
    request: Request,
    rag: Annotated[Rag, Depends(get_rag)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> AsyncIterator[Principal]:
    """The principal, as get_principal; the request is audited whether it is answered or refused.

    The route writes the entry of an answer (`audit_event(request, answer)`); a refusal here, or
    an error the route raises, is written here.
    """
    audit = request.state.audit = RequestAudit(route=request.url.path)
    try:
        caller = await asyncio.to_thread(resolve_caller, rag, request, credentials)
        audit.user, audit.key_id, audit.via_proxy = caller.principal.user, caller.key_id, caller.via_proxy
        yield caller.principal
    except Exception as exc:
        await audit_event(request, status=_status(request, exc))
        raise


def _status(request: Request, exc: Exception) -> int:
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, RagError):
        status = status_for(exc)
    elif isinstance(exc, RequestValidationError):
        status = 422
    else:
        return 500
    return 400 if status == 422 and is_openai_path(request.url.path) else status


RagDep = Annotated[Rag, Depends(get_rag)]
CallerDep = Annotated[Caller, Depends(get_caller)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
AuditedPrincipalDep = Annotated[Principal, Depends(get_audited_principal)]
