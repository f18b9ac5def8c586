"""Request dependencies: the Rag of the app, and the principal behind the bearer key."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from permissions.models import Principal
from rag.errors import AuthenticationError
from rag.pipeline import Rag

_bearer = HTTPBearer(auto_error=False)


def get_rag(request: Request) -> Rag:
    return request.app.state.rag


def get_principal(
    rag: Annotated[Rag, Depends(get_rag)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """401 (via AuthenticationError) for a missing, malformed, unknown or revoked key."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise AuthenticationError("invalid or missing API key")
    return rag.identity.authenticate(credentials.credentials)


RagDep = Annotated[Rag, Depends(get_rag)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
