"""Generating an answer over prepared sources: admission, the generator's stream, citations, timings.

`answer_events` is the one path every caller takes (the API's streaming and plain routes, the
OpenAI chat route, the CLI and notebooks through `Rag.query`): it waits for a generation slot,
streams the generator's text through the citation-marker filter, stops a small model that loops,
and records the queue wait apart from the generation itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rag.admission import AdmissionControl
from rag.citations import MarkerFilter
from rag.errors import DeadlineExceeded
from rag.generator import GenerationDone, GenerationRequest, Generator, TextDelta
from rag.prompts import RepeatGuard
from rag.types import Answer


@dataclass
class PreparedAnswer:
    """Retrieval done; what is left is generation (or nothing, when `request` is None).

    Attributes:
        answer: question, citations, hits and retrieval timings; `text` is set when no
            generation is needed (retrieval only, or the fixed "I don't know").
        request: what to ask the generator.
        started: perf_counter() when the query began (for the total).
    """

    answer: Answer
    request: GenerationRequest | None
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Admitted:
    """A generation slot was granted after `waited` seconds in the queue (the first event when generating)."""

    waited: float


@dataclass(frozen=True)
class AnswerDone:
    """The end of an answer: the final text is in `answer.text`, timings in `answer.timings`."""

    answer: Answer
    finish_reason: str
    usage: Usage


async def answer_events(prepared: PreparedAnswer, generator: Generator | None, admission: AdmissionControl,
                        deadline: float | None = None) -> AsyncIterator[Admitted | TextDelta | AnswerDone]:
    """Admitted (when generating), text deltas (markers to missing sources removed), then one AnswerDone.

    The AnswerDone's `answer.text` is the deltas joined, exactly: a streaming client that
    concatenates them holds the same answer (and citation offsets) as a non-streaming one.

    Routes wait for Admitted before they send response headers, so that a full queue is a real
    429 and not an error inside a 200 stream.

    Args:
        deadline: time.monotonic() by which the answer must be complete.

    Raises:
        OverloadedError: no generation slot and the queue is full.
        DeadlineExceeded: the deadline passed (the generation is aborted).
        GenerationError / GeneratorUnavailable: from the generator.
    """
    answer, timings = prepared.answer, prepared.answer.timings
    if prepared.request is None or generator is None:
        text = answer.text or ""
        if text:
            yield TextDelta(text)
        timings["total"] = time.perf_counter() - prepared.started
        yield AnswerDone(answer, "stop", Usage())
        return
    markers = MarkerFilter(len(answer.citations))
    guard = RepeatGuard()
    edges = _EdgeTrim()
    done: GenerationDone | None = None
    finish = "stop"
    remaining = None if deadline is None else deadline - time.monotonic()
    try:
        async with asyncio.timeout(remaining), admission.slot() as waited:
            timings["queue"] = waited
            yield Admitted(waited)
            t = time.perf_counter()
            async with contextlib.aclosing(generator.stream(prepared.request)) as events:
                async for event in events:
                    if isinstance(event, GenerationDone):
                        done = event
                        break
                    if "ttft" not in timings:
                        timings["ttft"] = time.perf_counter() - t
                    shown = edges.feed(guard.feed(markers.feed(event.text)))
                    if shown:
                        yield TextDelta(shown)
                    if guard.repeated:
                        break  # a small model looping: closing the stream aborts the request
            timings["generate"] = time.perf_counter() - t
    except TimeoutError as exc:
        raise DeadlineExceeded("the answer took longer than the request deadline; it was stopped") from exc
    tail = edges.feed(guard.feed(markers.flush()) + guard.flush())
    if tail:
        yield TextDelta(tail)
    answer.text = edges.text  # exactly the deltas: a client that joins them has the answer
    if done is not None:
        finish = done.finish_reason
    timings["total"] = time.perf_counter() - prepared.started
    usage = Usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens) if done else Usage()
    yield AnswerDone(answer, finish, usage)


class _EdgeTrim:
    """Passes streamed text on without its leading and trailing whitespace.

    Whitespace after the last text shown is held until more text follows it, so the deltas
    joined are always `text`, the stripped answer (its inner newlines and spacing kept).
    """

    def __init__(self) -> None:
        self.text = ""
        self._pending = ""

    def feed(self, delta: str) -> str:
        if not self.text:
            delta = delta.lstrip()
        delta = self._pending + delta
        shown = delta.rstrip()
        self._pending = delta[len(shown):]
        self.text += shown
        return shown
