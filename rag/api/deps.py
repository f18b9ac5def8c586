"""Request dependencies: the Rag of the app, and the caller behind the bearer key.

A user key stands for its own user and groups. A proxy key (`rag keys create --proxy`) stands
for a front end, which names its end user in one of `proxy_user_headers`; that user's groups
come from the directory (rules in permissions/proxy.py). The question routes take
`AuditedCallerDep`, which also writes the audit entry of a request that fails (rag/audit.py).

The key is checked before a byte of the body is read: routes read their body themselves
(`read_json`), after their dependencies, never past `max_request_bytes`. A key made with
`rag keys create --admin` is an admin caller: its answers carry stage timings.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from permissions.models import Principal
from permissions.proxy import ProxyError, resolve_proxy_user
from rag.api.errors import http_status, status_for
from rag.audit import RequestAudit, audit_event
from rag.errors import AuthenticationError, RagError
from rag.openai_wire import ApiError, Body, parse_json_body, read_body
from rag.pipeline import Rag

_bearer = HTTPBearer(auto_error=False)


@dataclass(frozen=True)
class Caller:
    """Who is asking (`principal`), through which key (`key_id`), whether a front end named them,
    and whether the key is an admin key (stage timings in answers)."""

    principal: Principal
    key_id: str
    via_proxy: bool = False
    is_admin: bool = False


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
    if key.principal is not None:  # a user key: user headers change nothing
        return Caller(key.principal, key.key_id, is_admin=rag.identity.is_admin(key.key_id))
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


async def get_audited_caller(
    request: Request,
    rag: Annotated[Rag, Depends(get_rag)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> AsyncIterator[Principal]:
    """The caller, as get_caller; the request is audited whether it is answered or refused.

    The route writes the entry of an answer (`audit_event(request, answer)`); a refusal here, or
    an error the route raises, is written here.
    """
    audit = request.state.audit = RequestAudit(route=request.url.path)
    try:
        caller = await asyncio.to_thread(resolve_caller, rag, request, credentials)
    except Exception as exc:
        if isinstance(exc, AuthenticationError):
            # The audit entry reads the body for its question hash: not for a caller without a key.
            request._body = b""
        else:  # a valid key refused later (a proxy key's user header): the body, capped, is audited
            with contextlib.suppress(ApiError):
                await read_body(request, rag.settings.max_request_bytes)
        await audit_event(request, status=_status(exc))
        raise
    audit.user, audit.key_id, audit.via_proxy = caller.principal.user, caller.key_id, caller.via_proxy
    try:
        yield caller
    except Exception as exc:
        await audit_event(request, status=_status(exc))
        raise


async def read_json(request: Request, rag: Rag, schema: type[Body]) -> Body:
    """The request's JSON body as `schema`: read after the key is checked, never past max_request_bytes.

    Raises:
        ApiError: 413 for a body over the cap; 400 for one that is not JSON or does not fit `schema`.
    """
    cap = rag.settings.max_request_bytes
    return parse_json_body(await read_body(request, cap), schema, cap)


def json_body_schema(schema: type[BaseModel]) -> dict:
    """An OpenAPI requestBody for a route that reads its body itself (so the key is checked first).

    Nested models are inlined, so the schema stands alone in `openapi_extra`.
    """
    full = schema.model_json_schema()
    defs = full.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(full)}}}}


def _status(exc: Exception) -> int:
    if isinstance(exc, ApiError):
        return http_status(exc.status)
    if isinstance(exc, RagError):
        return http_status(status_for(exc))
    if isinstance(exc, RequestValidationError):
        return 400
    return 500


RagDep = Annotated[Rag, Depends(get_rag)]
CallerDep = Annotated[Caller, Depends(get_caller)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
AuditedCallerDep = Annotated[Caller, Depends(get_audited_caller)]
