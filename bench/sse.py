"""Server-sent events of an OpenAI-style streaming response, as the load benchmarks read them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


class BadStatus(Exception):
    """The server answered the streaming request with another status than 200."""


async def sse_events(client: Any, url: str, body: dict, headers: dict[str, str]) -> AsyncIterator[dict | None]:
    """POST `body` with httpx's `client.stream` and yield each `data:` event parsed, then None at `[DONE]`.

    A stream that ends without `[DONE]` yields no None, so the caller can tell a cut stream from a
    finished one. A non-200 answer raises BadStatus with the status and the start of the body.
    """
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise BadStatus(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                yield None
                return
            yield json.loads(data)
