"""RemoteGenerator: the Generator protocol over any OpenAI-compatible server (vLLM, SGLang, `rag engine serve`)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import httpx

from rag.errors import ConfigError, GenerationError, GeneratorUnavailable, OverloadedError
from rag.generator import GenerationDone, GenerationEvent, GenerationRequest, TextDelta

if TYPE_CHECKING:
    from rag.settings import Settings

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 3.5  # English text with BPE vocabularies of 32k-150k tokens: about 3.5-4.5 characters a token
READY_TTL_SECONDS = 10.0  # how long a readiness probe's answer is trusted
PROBE_TIMEOUT_SECONDS = 5.0
MAX_ERROR_CHARS = 500


class RemoteGenerator:
    """Streams chat completions from an OpenAI-compatible server.

    Every request goes to `{base_url}/chat/completions` with `stream: true` and
    `stream_options.include_usage`, so usage arrives in the stream. With `cache_salt="user"` a
    request's `user_salt` is sent as vLLM's `cache_salt`: the server then shares cached KV only
    between requests of the same principal (one salt per request: `GenerationRequest.segments`
    cannot be expressed remotely). The key goes only into the Authorization header; it is never
    logged and is scrubbed from every error message.

    Args:
        base_url: the server's OpenAI base, e.g. `http://gpu01:8000/v1`.
        model: the model id to request; None takes the first id of `GET /models` (asked once).
        api_key: bearer key of the server, or None.
        cache_salt: "user" sends `user_salt` as `cache_salt`; "off" sends none.
        timeout: seconds one generation may take in all (also the limit on each network read).
        client: an httpx.AsyncClient to use (not closed by aclose); one is made when None.

    Raises:
        ConfigError: an empty base URL or a cache_salt mode that does not exist.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        cache_salt: Literal["user", "off"] = "user",
        timeout: float = 120.0,
        *,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"the remote generator URL must start with http:// or https://, got {base_url!r}")
        if cache_salt not in ("user", "off"):
            raise ConfigError(f"cache_salt must be 'user' or 'off', got {cache_salt!r}")
        self.base_url = base_url.rstrip("/")
        self.cache_salt = cache_salt
        self.timeout = timeout
        self._model = model
        self._key = api_key or None
        self._given_client = client
        self._own_client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._ready: bool | None = None
        self._ready_at = -math.inf
        self._probe: asyncio.Task[bool] | None = None

    # --- the Generator protocol -------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The configured model, else the server's first model once known ("" before that)."""
        return self._model or ""

    def count_tokens(self, text: str) -> int:
        """An estimate, ceil(characters / 3.5): the server's tokenizer is not available here.

        It errs towards more tokens for English prose; the server still refuses prompts that do
        not fit its context (a GenerationError).
        """
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def is_ready(self) -> bool:
        """The last probe's answer (`GET /models`); a stale one starts a new probe in the background.

        False until a probe (or a generation) has succeeded: await `check_ready()` at start-up.
        """
        if time.monotonic() - self._ready_at > READY_TTL_SECONDS and (self._probe is None or self._probe.done()):
            try:
                self._probe = asyncio.get_running_loop().create_task(self.check_ready())
            except RuntimeError:
                pass  # no event loop here: keep the last answer
        return bool(self._ready)

    async def check_ready(self) -> bool:
        """Probe `GET {base_url}/models` now (and learn the model id if none was given)."""
        try:
            model = await self._first_model(timeout=min(self.timeout, PROBE_TIMEOUT_SECONDS))
            if self._model is None:
                self._model = model
            self._set_ready(True)
        except GenerationError as e:
            logger.warning("remote generator not ready: %s", e)
            self._set_ready(False)
        return bool(self._ready)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """TextDelta events as the server streams them, then one GenerationDone.

        Closing the iterator early closes the HTTP response, which makes the server abort the request.

        Raises:
            GenerationError: the server refused the request (4xx), with its message.
            OverloadedError: the server answered 429 (retry after its Retry-After).
            GeneratorUnavailable: the server is unreachable, failed (5xx), timed out or broke the stream.
        """
        model = self._model or await self._discover_model()
        body = self._body(request, model)
        url = f"{self.base_url}/chat/completions"
        started = time.monotonic()
        first_token: float | None = None
        finish_reason: str | None = None
        usage: dict[str, Any] = {}
        try:
            async with self._client.stream("POST", url, json=body, headers=self._headers()) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise self._http_error(response)
                async for data in _sse_data(response):
                    if time.monotonic() - started > self.timeout:
                        raise GeneratorUnavailable(
                            f"the remote generator at {self.base_url} took longer than {self.timeout:g} s")
                    if data == "[DONE]":
                        break
                    chunk = _parse_chunk(data, self.base_url)
                    if "error" in chunk:
                        raise GenerationError(self._scrub(
                            f"the remote generator at {self.base_url} failed mid-stream: {_message(chunk)}"))
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if first_token is None:
                                first_token = time.monotonic() - started
                            yield TextDelta(text)
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
        except httpx.TimeoutException as e:
            self._set_ready(False)
            raise GeneratorUnavailable(
                f"the remote generator at {self.base_url} did not answer within {self.timeout:g} s "
                f"({type(e).__name__})") from None
        except httpx.HTTPError as e:
            self._set_ready(False)
            raise GeneratorUnavailable(self._scrub(
                f"the remote generator at {self.base_url} is unreachable ({type(e).__name__}: {e}); "
                "check generator_url and that the server runs")) from None
        if finish_reason is None:
            self._set_ready(False)
            raise GeneratorUnavailable(f"the remote generator at {self.base_url} ended the stream before finishing")
        self._set_ready(True)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        yield GenerationDone(
            finish_reason=finish_reason,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(cached) if cached is not None else None,
            time_to_first_token=first_token,
        )

    async def aclose(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
        if self._own_client is not None and self._client_loop is asyncio.get_running_loop():
            await self._own_client.aclose()
        self._own_client = None

    # --- helpers ----------------------------------------------------------------------------------

    @property
    def _client(self) -> httpx.AsyncClient:
        if self._given_client is not None:
            return self._given_client
        # Pooled connections belong to the event loop that opened them: a caller that runs each
        # generation in its own asyncio.run() gets a fresh client instead of dead connections.
        loop = asyncio.get_running_loop()
        if self._own_client is None or self._client_loop is not loop:
            self._own_client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)))
            self._client_loop = loop
        return self._own_client

    def _body(self, request: GenerationRequest, model: str) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in request.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        if self.cache_salt == "user" and request.user_salt:
            body["cache_salt"] = request.user_salt
        return body

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    async def _discover_model(self) -> str:
        model = await self._first_model(timeout=self.timeout)
        self._model = model
        return model

    async def _first_model(self, timeout: float) -> str:
        url = f"{self.base_url}/models"
        try:
            response = await self._client.get(url, headers=self._headers(), timeout=timeout)
        except httpx.HTTPError as e:
            raise GeneratorUnavailable(self._scrub(
                f"the remote generator at {self.base_url} is unreachable ({type(e).__name__}: {e}); "
                "check generator_url and that the server runs")) from None
        if response.status_code >= 400:
            raise self._http_error(response)
        try:
            models = response.json()["data"]
            return str(models[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise GeneratorUnavailable(
                f"the remote generator at {self.base_url} answered GET /models without a model list: "
                "is generator_url the server's OpenAI base (ending in /v1)?") from None

    def _http_error(self, response: httpx.Response) -> GenerationError | OverloadedError:
        status = response.status_code
        try:
            detail = _message(response.json())
        except ValueError:
            detail = response.text[:MAX_ERROR_CHARS]
        where = f"the remote generator at {self.base_url}"
        if status in (401, 403):
            return GenerationError(self._scrub(
                f"{where} refused the API key ({status}: {detail}); check generator_api_key"))
        if status == 429:
            retry = _retry_after(response.headers.get("retry-after"))
            return OverloadedError(self._scrub(f"{where} is overloaded (429: {detail})"), retry_after=retry)
        if status >= 500:
            self._set_ready(False)
            return GeneratorUnavailable(self._scrub(f"{where} failed ({status}: {detail})"))
        return GenerationError(self._scrub(f"{where} refused the request ({status}: {detail})"))

    def _scrub(self, message: str) -> str:
        # A server or proxy may echo the key back in an error; it must not reach logs from here.
        return message.replace(self._key, "***") if self._key else message

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        self._ready_at = time.monotonic()


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def _parse_chunk(data: str, base_url: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise GeneratorUnavailable(f"the remote generator at {base_url} sent a stream event that is not JSON") from None
    if not isinstance(chunk, dict):
        raise GeneratorUnavailable(f"the remote generator at {base_url} sent a stream event that is not an object")
    return chunk


def _message(body: Any) -> str:
    """The message of an OpenAI-shaped error body (or the body itself, shortened)."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MAX_ERROR_CHARS]
        if isinstance(error, str):
            return error[:MAX_ERROR_CHARS]
        if body.get("detail"):
            return str(body["detail"])[:MAX_ERROR_CHARS]
    return str(body)[:MAX_ERROR_CHARS]


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def make_remote_generator(settings: Settings, *, client: httpx.AsyncClient | None = None) -> RemoteGenerator:
    """The RemoteGenerator that `settings` describe (generator_url, _model, key, _cache_salt, _timeout).

    Raises:
        ConfigError: generator_url is not set, or the key file is unreadable.
    """
    if not settings.generator_url:
        raise ConfigError(
            "the remote generator needs generator_url (RAG_GENERATOR_URL), the server's OpenAI base, "
            "e.g. http://gpu01:8000/v1")
    return RemoteGenerator(
        settings.generator_url,
        model=settings.generator_model,
        api_key=settings.generator_key(),
        cache_salt=settings.generator_cache_salt,
        timeout=settings.generator_timeout,
        client=client,
    )
