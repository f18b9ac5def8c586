"""AsyncLLMEngine: a background thread steps the engine while asyncio consumers stream their requests' deltas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from generation.config import EngineConfig
from generation.engine.cache_namespaces import NamespaceSpec
from generation.engine.llm_engine import LLMEngine, Request, RequestUpdate
from generation.engine.metrics import MetricsSnapshot
from generation.engine.prompt_segments import PromptSegment
from generation.sampling_params import SamplingParams
from rag.errors import GenerationError
from rag.switch_interval import acquire_shorter, release_shorter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Channel:
    """Where a request's updates go: a queue owned by the consumer's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestUpdate | BaseException]


class AsyncLLMEngine:
    """Serves many concurrent requests from asyncio code over one LLMEngine.

    The engine is touched only by a background thread, which applies queued additions and aborts
    between steps and steps while there is work (sleeping otherwise), so a consumer's event loop
    never waits for a model step. A request whose consumer goes away (the async generator is
    closed, or its task cancelled) is aborted and its KV blocks are freed.

    Args:
        engine: the engine to drive; nothing else may call its add/abort/step meanwhile.
        switch_interval_ms: while the step thread runs a CUDA engine, the process's GIL switch
            interval is at most this (0: left as it is). Each torch op of a step releases the GIL
            and must take it back before the next launch; beside the event loop's Python (HTTP,
            streaming, retrieval) it could wait the interpreter's whole 5 ms for it per op
            (rag/switch_interval.py). Restored at shutdown.
    """

    def __init__(self, engine: LLMEngine, switch_interval_ms: float = 0.0) -> None:
        self.engine = engine
        self._shorter_switch = switch_interval_ms > 0 and engine.model_runner.device.type == "cuda"
        if self._shorter_switch:
            acquire_shorter(switch_interval_ms)
        self._cv = threading.Condition()
        # Guarded by _cv: work handed to the step thread, and the registered consumers.
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[int] = []
        self._channels: dict[int, _Channel] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llm-engine-step", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str | Path, config: EngineConfig | None = None) -> AsyncLLMEngine:
        """Load a model folder into a new engine and serve it."""
        return cls(LLMEngine(model, config))

    @property
    def is_running(self) -> bool:
        """False as soon as the engine failed or began shutting down (the thread may still be exiting)."""
        with self._cv:
            return self._error is None and not self._stopping and self._thread.is_alive()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, namespace: NamespaceSpec = None
    ) -> AsyncIterator[str]:
        """Yield the request's text deltas as they appear (never any part of a stop string).

        `namespace`: one prefix-cache namespace, or `(token_offset, namespace)` regions over the
        prompt's token ids; see LLMEngine.add_request.

        Raises:
            GenerationError: a bad request (raised before anything is queued), or the engine failed.
        """
        # aclosing: when our consumer leaves, the inner generator must close now (and abort the
        # request), not whenever the garbage collector gets to it.
        async with contextlib.aclosing(self.generate_updates(prompt, params, namespace)) as updates:
            async for update in updates:
                if update.text_delta:
                    yield update.text_delta

    async def generate_updates(
        self, prompt: str | list[int], params: SamplingParams | None = None, namespace: NamespaceSpec = None
    ) -> AsyncIterator[RequestUpdate]:
        """Yield every RequestUpdate of a new request (tokens, text delta; the last has the output).

        `namespace`: one prefix-cache namespace, or `(token_offset, namespace)` regions over the
        prompt's token ids; see LLMEngine.add_request.

        Raises:
            GenerationError: a bad request (raised before anything is queued), or the engine failed.
        """
        # Validation runs here, in the caller: a bad prompt raises to its own consumer.
        async with contextlib.aclosing(self._stream(self.engine.make_request(prompt, params, namespace))) as updates:
            async for update in updates:
                yield update

    async def generate_segmented_updates(
        self, segments: Sequence[PromptSegment], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestUpdate]:
        """Yield every RequestUpdate of a prompt given as segments (LLMEngine.add_segmented_request).

        Raises:
            GenerationError: malformed segments or a bad request (raised before anything is
                queued), or the engine failed.
        """
        async with contextlib.aclosing(self._stream(self.engine.make_segmented_request(segments, params))) as updates:
            async for update in updates:
                yield update

    async def _stream(self, request: Request) -> AsyncIterator[RequestUpdate]:
        """Queue a built request for the step thread and yield its updates; abort it if left early."""
        request_id = request.request_id
        channel = _Channel(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            self._raise_if_failed()
            self._channels[request_id] = channel
            self._pending_adds.append(request)
            self._cv.notify()
        finished = False
        try:
            while True:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    raise GenerationError(f"the generation engine failed: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Closed, cancelled or failed before the end: the engine must drop the request.
            with self._cv:
                self._channels.pop(request_id, None)
                if not finished:
                    self._pending_aborts.append(request_id)
                    self._cv.notify()

    def get_metrics(self) -> MetricsSnapshot:
        """A snapshot of the engine's counters (read without stopping the step thread)."""
        return self.engine.get_metrics()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the step thread after its current step; waiting consumers get an error."""
        with self._cv:
            already, self._stopping = self._stopping, True
            self._cv.notify()
        if self._shorter_switch and not already:
            release_shorter()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---------------------------------------------------------------------------------------------
    # The step thread
    # ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._stopping or self._pending_adds or self._pending_aborts
                           or engine.has_unfinished_requests()):  # fmt: skip
                    self._cv.wait()
                if self._stopping:
                    break
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
            try:
                for request in adds:
                    engine.add(request)
                for request_id in aborts:
                    engine.abort(request_id)
                updates = engine.step(self._addition_waiting) if engine.has_unfinished_requests() else []
            except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it, then the thread ends
                logger.exception("generation engine step failed")
                self._fail(exc)
                return
            for update in updates:
                self._deliver(update)
        self._fail(GenerationError("the generation engine was shut down"))

    def _addition_waiting(self) -> bool:
        """A request is queued for the step thread to add: the running batch may end early for it.

        Read without the lock (a list's truth is one atomic read): a stale answer costs one
        step either way, and taking the lock between steps would make the submitters wait.
        """
        return bool(self._pending_adds)

    def _deliver(self, update: RequestUpdate) -> None:
        with self._cv:
            channel = self._channels.get(update.request_id)
        if channel is None:
            return  # the consumer left; its abort is queued (and a no-op once finished)
        try:
            channel.loop.call_soon_threadsafe(channel.queue.put_nowait, update)
        except RuntimeError:
            # The consumer's event loop is closed: nobody will read this request any more.
            with self._cv:
                self._channels.pop(update.request_id, None)
                if not update.finished:
                    self._pending_aborts.append(update.request_id)

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            try:
                channel.loop.call_soon_threadsafe(channel.queue.put_nowait, exc)
            except RuntimeError:
                pass  # loop closed: that consumer is gone

    def _raise_if_failed(self) -> None:
        if self._error is not None or self._stopping:
            raise GenerationError(f"the generation engine is not running: {self._error or 'shut down'}")
