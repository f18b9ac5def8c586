"""The generator seam: one async, streaming protocol for the local engine and remote OpenAI servers.

The pipeline, the CLI and the API talk to a `Generator` only. Implementations:
`rag.generators.local.LocalGenerator` (our engine through AsyncLLMEngine, continuous batching
across every user's requests) and `rag.generators.remote.RemoteGenerator` (any OpenAI-compatible
server: vLLM, SGLang, TGI, llama.cpp, LiteLLM, `rag engine serve`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Message = dict[str, str]


@dataclass(frozen=True)
class GenerationParams:
    """How to sample, for any generator (a subset of the OpenAI request fields).

    Raises:
        ValueError: a value out of range (the message names the valid range).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be at most 4 non-empty strings, got {self.stop!r}")


SHARED_NAMESPACE = "rag:system"  # the prompt's head (chat template, system prompt): shared by every principal

SegmentKind = Literal["text", "label", "chunk"]


@dataclass(frozen=True)
class CacheSegment:
    """A piece of the prompt whose KV blocks belong to one prefix-cache namespace.

    Two ways to give segments (see `GenerationRequest.segments`):
    - **Parts**: the segments' texts concatenate to the last message's content. The local engine
      then tokenizes each segment on its own and concatenates the ids (`rag.prompt_layout`), so
      a segment's ids never depend on its neighbours; `kind` says how it is aligned to KV blocks:
      a "chunk" is padded after its text so that what follows starts on a block boundary, a
      "label" is padded before its text so that the chunk after it starts on one; "text" is
      not padded.
    - **Substrings** of the messages' contents, found in the rendered prompt in the order given;
      a segment's namespace holds from its first token up to the next segment's first token.
      Text before the first segment (the chat template's header, the system prompt) is in
      `GenerationRequest.base_namespace`; `kind` is ignored.
    """

    text: str
    namespace: str
    kind: SegmentKind = "text"


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: chat messages, sampling, and who may share its cached KV.

    Attributes:
        messages: OpenAI-style chat messages (role, content strings).
        params: sampling parameters.
        segments: cache namespaces per piece of the prompt (sources by their ACL, the history and
            the question salted per user), as parts of the last message or as substrings (see
            CacheSegment); empty means the whole prompt is in `user_salt`'s domain.
        base_namespace: the namespace of the prompt's head, before the first segment.
        user_salt: a server-derived per-principal salt, for generators that take only one salt
            per request (vLLM's `cache_salt`): never chosen by a client.
    """

    messages: list[Message]
    params: GenerationParams = field(default_factory=GenerationParams)
    segments: Sequence[CacheSegment] = ()
    base_namespace: str = SHARED_NAMESPACE
    user_salt: str | None = None


@dataclass(frozen=True)
class TextDelta:
    """New answer text."""

    text: str


@dataclass(frozen=True)
class GenerationDone:
    """The last event of a stream: why it stopped and what it cost.

    Attributes:
        finish_reason: "stop" or "length".
        prompt_tokens, completion_tokens: as the generator counted them (0 when it did not say).
        cached_tokens: prompt tokens served from the prefix cache (None when unknown).
        time_to_first_token: seconds from the request reaching the generator to its first token.
    """

    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    time_to_first_token: float | None = None


GenerationEvent = TextDelta | GenerationDone


@runtime_checkable
class Generator(Protocol):
    """What the pipeline needs from a text generator."""

    @property
    def model_name(self) -> str:
        """The model's name, as reported to clients."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes in a prompt (exact for the local engine, an estimate otherwise)."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """TextDelta events as they are produced, then exactly one GenerationDone.

        Closing the iterator early (a client disconnect, a deadline) aborts the generation and
        frees what it holds.

        Raises:
            GenerationError: a request the generator refuses (prompt too long, bad parameters).
            GeneratorUnavailable: the generator is down or failed.
        """
        ...

    def is_ready(self) -> bool:
        """Whether a generation started now can succeed (the engine runs, the server answers)."""
        ...

    async def aclose(self) -> None:
        """Stop background work and release the model or connections."""
        ...


@dataclass(frozen=True)
class CachedPrefix:
    """How much of a request's prompt the generator's prefix cache holds now.

    Attributes:
        num_tokens: leading prompt tokens whose KV is cached (whole KV blocks).
        chunk_ends: token offset just past each "chunk" segment, in prompt order (padding
            included): a chunk is wholly cached when `num_tokens >= chunk_ends[i]`.
    """

    num_tokens: int
    chunk_ends: tuple[int, ...] = ()


@runtime_checkable
class PrefixCacheProbe(Protocol):
    """A generator that can say what of a prompt is cached (the local engine; remote servers cannot)."""

    def cached_prefix(self, request: GenerationRequest) -> CachedPrefix:
        """The cached part of `request`'s prompt under its namespaces, without side effects.

        Reading it changes nothing: no reference, no LRU order, no hit counter moves. The answer
        can be stale by the time the request runs (it only guides the order of sources).
        """
        ...


@runtime_checkable
class ChunkReuseProbe(Protocol):
    """A generator that reuses a chunk's KV at any position (the local engine with kv_reuse="chunks")."""

    def source_to_lead(self, request: GenerationRequest) -> int | None:
        """Which of `request`'s sources (an index in its order) to place first, or None for no preference.

        The first source is computed as the chunk's own reusable KV, for free; a missed source
        elsewhere costs a second computation once it is worth keeping. Read-only, like
        `PrefixCacheProbe.cached_prefix`.
        """
        ...
