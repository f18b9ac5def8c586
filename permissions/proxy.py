"""Trusted-proxy rules: which end user a front end's proxy key names, and when to refuse.

A proxy key stands for a front end (Open WebUI, LibreChat, LiteLLM), which names the user it
serves in a request header. The rules, in order:

1. The first of the configured header names (`proxy_user_headers`) that is present with a
   non-blank value wins; a blank value counts as absent. None present: 403 (the key must name its user).
2. The value must be at most 256 characters, free of control characters, and a valid user name
   (letters, digits and . _ - + @): otherwise 400. Nothing is trimmed or case-folded but the
   surrounding blanks.
3. The value names a user registered in the directory (`rag users add NAME --group G`), matched
   exactly: an email header matches a user registered under the full email address, never its
   local part (matching alice@anywhere to `alice` would let anyone who can sign up to the front
   end with such an address read as alice). Not registered: 403, the same message for every name.
4. The groups come from the directory, never from the request: group and role headers are ignored.

Headers only matter for proxy keys: a user key's own principal applies whatever it sends.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping, Sequence

from permissions.models import Principal, check_name
from rag.errors import ConfigError, PermissionDenied

MAX_HEADER_CHARS = 256
DEFAULT_USER_HEADERS = ("X-OpenWebUI-User-Email", "X-OpenWebUI-User-Name", "X-Forwarded-User")


class ProxyError(PermissionDenied):
    """A proxy key's request that names no user, a bad one or an unknown one; `status` is its HTTP code."""

    status = 403
    code = "proxy_user_required"


class MissingUserHeader(ProxyError):
    status, code = 403, "proxy_user_required"


class MalformedUserHeader(ProxyError):
    status, code = 400, "invalid_proxy_user"


class UnknownProxyUser(ProxyError):
    status, code = 403, "proxy_user_unknown"


def asserted_user(headers: Mapping[str, str], header_names: Sequence[str]) -> tuple[str, str]:
    """The header that names the user and its value (blanks around it removed).

    Args:
        headers: the request's headers (a case-insensitive mapping, such as Starlette's).
        header_names: the header names to look at, in order; the first present wins.

    Raises:
        MissingUserHeader: none of them is present with a non-blank value.
        MalformedUserHeader: the value is too long, holds control characters or is not a user name.
    """
    for name in header_names:
        raw = headers.get(name)
        if raw is None or not raw.strip():
            continue
        return name, check_user_value(name, raw)
    wanted = " or ".join(header_names) or "a user header (proxy_user_headers is empty)"
    raise MissingUserHeader(f"this key is a front-end key: it must name the user in {wanted}")


def check_user_value(header: str, raw: str) -> str:
    """The user name a header value asserts.

    Raises:
        MalformedUserHeader: longer than MAX_HEADER_CHARS, control characters, or not a valid user name.
    """
    if len(raw) > MAX_HEADER_CHARS:
        raise MalformedUserHeader(f"the {header} header is longer than {MAX_HEADER_CHARS} characters")
    if any(unicodedata.category(ch).startswith("C") for ch in raw):
        raise MalformedUserHeader(f"the {header} header holds control characters")
    value = raw.strip()
    try:
        check_name(value, "user")
    except ConfigError:
        raise MalformedUserHeader(
            f"the {header} header does not hold a valid user name (letters, digits and . _ - + @)"
        ) from None
    return value


def resolve_proxy_user(headers: Mapping[str, str], header_names: Sequence[str],
                       registered: Callable[[str], Principal | None]) -> Principal:
    """The principal a proxy key's request stands for: the named user with the directory's groups.

    Args:
        headers: the request's headers.
        header_names: `proxy_user_headers`, in order.
        registered: looks a user up in the directory (None if not registered; no system users).

    Raises:
        MissingUserHeader, MalformedUserHeader, UnknownProxyUser (see the module's rules).
    """
    header, user = asserted_user(headers, header_names)
    principal = registered(user)
    if principal is None:
        # Says nothing about which users exist: one message for every unknown name.
        raise UnknownProxyUser(f"the user named in {header} is not registered with this service "
                               "(an operator adds users with `rag users add NAME --group G`)")
    return principal
