"""`rag query --server URL`: ask a running `rag serve` (models already loaded) instead of loading them here.

The key says who asks, so there is no --as: the server answers from what the key's user may read.
Answers come back in the same dict shape as a local query's `--json` (`rag.cli.answer_to_dict`),
so one function prints both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx

from rag.errors import ConfigError, RagError
from rag.settings import warn_if_readable_by_others

KEY_ENV = "RAG_API_KEY"
# Generation on a CPU server can take minutes; connecting should not.
TIMEOUT = httpx.Timeout(600.0, connect=10.0)
# At least this share of a local query's time spent loading models earns the `rag serve` hint.
LOAD_SHARE_HINT = 0.5


class ServerQueryError(RagError):
    """The server refused or failed the query; `exit_code` 2 for usage and auth, 1 for the rest."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resolve_api_key(key_file: Path | None, env: Mapping[str, str]) -> str:
    """The API key: the first line of `key_file`, else RAG_API_KEY (never a command-line argument).

    Raises:
        ConfigError: no key anywhere, or the file cannot be read or is empty.
    """
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --key-file {key_file}: {e.strerror}") from e
        if not key:
            raise ConfigError(f"--key-file {key_file} is empty: put the key from `rag keys create` in it")
        warn_if_readable_by_others(key_file, "--key-file")
        return key.splitlines()[0].strip()
    key = env.get(KEY_ENV, "").strip()
    if not key:
        raise ConfigError(f"--server needs an API key: set {KEY_ENV}, or pass --key-file FILE (a file only "
                          "you can read: chmod 600 FILE); `rag keys create --user NAME` on the server makes one")
    return key


def query_server(server: str, key: str, question: str, *, collection: str | None = None, k: int | None = None,
                 generate: bool = True, mode: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> dict:
    """POST /v1/query and return the answer as `rag.cli.answer_to_dict` shapes a local one.

    Raises:
        ServerQueryError: the server could not be reached, or answered with an error.
    """
    body: dict[str, object] = {"question": question, "generate": generate}
    for name, value in (("collection", collection), ("k", k), ("mode", mode)):
        if value is not None:
            body[name] = value
    url = server.rstrip("/") + "/v1/query"
    try:
        with httpx.Client(timeout=TIMEOUT, transport=transport) as client:
            response = client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError as e:
        raise ServerQueryError(f"cannot reach the server at {server}: {_reason(e)}; is `rag serve` running "
                               "there (and is the URL right)?", 1) from e
    if response.status_code != 200:
        raise _error_for(response, server)
    try:
        return response_to_dict(response.json())
    except (ValueError, KeyError, TypeError) as e:
        raise ServerQueryError(f"{server} answered 200 but not with a /v1/query answer: is it `rag serve`?",
                               1) from e


def response_to_dict(data: dict) -> dict:
    """A /v1/query response body in the `--json` shape of a local query.

    The server does not say which groups the key has (`groups` is null) and gives stage
    timings to admin keys only (`timings_ms` is null for others).
    """
    return {
        "question": data["question"],
        "user": data["user"],
        "groups": None,
        "answer": data["answer"],
        "answer_mode": data.get("answer_mode"),  # absent from servers older than the field
        "citations": [
            {"number": c["number"], "source": c["source"], "document": c["document"], "chunk": c["chunk"],
             "score": round(c["score"], 4), "relevance": _round(c.get("relevance")), "rank": c.get("rank"),
             "text": c["text"]}
            for c in data["citations"]
        ],
        "timings_ms": data.get("timings_ms"),
    }


def loading_dominates(timings: Mapping[str, float]) -> bool:
    """Whether loading models (the `load_*` stages) took more than half of the query's total time."""
    total = timings.get("total", 0.0)
    loading = sum(v for name, v in timings.items() if name.startswith("load_"))
    return total > 0 and loading > LOAD_SHARE_HINT * total


def load_hint(timings: Mapping[str, float]) -> str | None:
    """The one-line stderr hint for a local query that mostly loaded models, else None."""
    if not loading_dominates(timings):
        return None
    loading = sum(v for name, v in timings.items() if name.startswith("load_"))
    return (f"hint: {loading:.1f} s of this query's {timings['total']:.1f} s went to loading models; "
            "keep them loaded with `rag serve` and ask it with `rag query --server URL` (key in RAG_API_KEY "
            "or --key-file)")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _reason(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.TimeoutException):
        return "it did not answer in time"
    if isinstance(e, httpx.ConnectError):
        return "connection refused or host unknown"
    return type(e).__name__


def _error_for(response: httpx.Response, server: str) -> ServerQueryError:
    status = response.status_code
    message = _server_message(response)
    if status == 401:
        return ServerQueryError(f"the server refused the key (401): {message}; check {KEY_ENV} or --key-file "
                                "(`rag keys list` on the server shows which keys are active)", 2)
    if status == 403:
        return ServerQueryError(f"the key may not do this (403): {message}", 2)
    if status == 404:
        return ServerQueryError(f"not found (404): {message}", 2)
    if status in (400, 413, 422):
        return ServerQueryError(f"the server refused the request ({status}): {message}", 2)
    if status == 429:
        retry = response.headers.get("Retry-After")
        wait = f"; retry in {retry} s" if retry else "; retry shortly"
        return ServerQueryError(f"the server is busy (429): {message}{wait}", 1)
    return ServerQueryError(f"the server failed ({status}): {message}", 1)


def _server_message(response: httpx.Response) -> str:
    """The message of OpenAI's {"error": {"message": ...}} shape, or the status text."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if not isinstance(message, str) or not message.strip():
        return response.reason_phrase or "no message"
    return " ".join(message.split())  # one line, whatever the server sent
