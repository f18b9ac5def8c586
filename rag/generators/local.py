"""LocalGenerator: our engine in this process, through AsyncLLMEngine (continuous batching).

Every request of every user goes into one engine, which batches them step by step and shares
cached KV blocks between requests whose prompt segments are in the same namespace. The engine
gets token ids and `(token offset, namespace)` regions: for a RAG prompt (segments that are the
parts of the user turn) the block-aligned layout of `rag.prompt_layout`, in which a chunk's ids
are the same in every prompt; for any other request the rendered prompt tokenized whole.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from rag.errors import GenerationError, GeneratorUnavailable
from rag.generator import (
    CachedPrefix,
    CacheSegment,
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
)
from rag.prompt_layout import PromptLayout, lay_out, pad_token_id

log = logging.getLogger(__name__)


class LocalGenerator:
    """The Generator protocol over an AsyncLLMEngine.

    Args:
        model_dir: a local model folder (see generation.loader.resolve_model_dir).
        device: "cpu", "cuda"; None picks CUDA when available.
        max_num_seqs: most sequences the engine runs at once (None: the engine's default).
        num_kv_blocks: KV cache size in blocks (None: sized from free memory).
        engine: an already running AsyncLLMEngine to use instead of loading model_dir.
        kv_reuse: the engine's chunk KV reuse ("exact" or "chunks"; None: the engine's default).
            With "chunks", a RAG prompt goes to the engine as its layout's segments (head, labels,
            chunks, suffix), so a chunk's KV is reused wherever it lands.
        host_kv_blocks: blocks of the engine's host-memory KV tier (None or 0: off).
        quantization: None or "fp8" (EngineConfig.quantization); kv_cache_dtype: "auto" or "fp8".
        max_num_batched_tokens: most tokens an engine step computes (None: the engine's default,
            raised to max_num_seqs).
        switch_interval_ms: the GIL switch interval while the engine steps on a GPU (see
            AsyncLLMEngine; 0: the interpreter's).
    """

    def __init__(self, model_dir: Path | None = None, device: str | None = None,
                 max_num_seqs: int | None = None, num_kv_blocks: int | None = None,
                 engine: Any | None = None, kv_reuse: str | None = None,
                 host_kv_blocks: int | None = None, quantization: str | None = None,
                 kv_cache_dtype: str | None = None, switch_interval_ms: float = 0.0,
                 max_num_batched_tokens: int | None = None) -> None:
        from generation.engine.async_engine import AsyncLLMEngine

        if engine is None:
            from generation.config import EngineConfig
            from generation.engine.llm_engine import LLMEngine

            assert model_dir is not None, "pass model_dir or engine"
            overrides = {k: v for k, v in {"device": device, "max_num_seqs": max_num_seqs,
                                            "num_kv_blocks": num_kv_blocks, "kv_reuse": kv_reuse,
                                            "host_kv_blocks": host_kv_blocks or None,
                                            "quantization": quantization,
                                            "kv_cache_dtype": kv_cache_dtype}.items()
                         if v is not None}
            if max_num_batched_tokens is not None:
                overrides["max_num_batched_tokens"] = max_num_batched_tokens
            elif max_num_seqs is not None:
                overrides["max_num_batched_tokens"] = max(EngineConfig.max_num_batched_tokens, max_num_seqs)
            engine = AsyncLLMEngine(LLMEngine(model_dir, EngineConfig(**overrides)), switch_interval_ms)
        self.engine: AsyncLLMEngine = engine
        self.tokenizer = engine.engine.tokenizer
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise GenerationError("the local generator needs a model with a tokenizer and a chat template "
                                  "(an instruct model)")
        self._model_name = Path(engine.engine.model_dir).name
        self.block_size: int = engine.engine.config.block_size
        self.pad_token_id = pad_token_id(self.tokenizer)
        if self.pad_token_id is None:
            log.warning("the tokenizer has no one-token newline or space: sources are not aligned to KV blocks")
        # Popular chunks come back in many prompts, and the source order probes lay prompts out
        # several times: tokenize each distinct piece once.
        self._encode = functools.lru_cache(maxsize=4096)(self._encode_uncached)

    @property
    def model_name(self) -> str:
        return self._model_name

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def is_ready(self) -> bool:
        return self.engine.is_running

    def metrics(self):
        """The engine's counters (queues, KV blocks, prefix-cache hits, batch sizes)."""
        return self.engine.get_metrics()

    def prompt(self, request: GenerationRequest) -> tuple[list[int], list[tuple[int, str | None]]]:
        """The prompt's token ids and its namespace regions (token offset, namespace).

        Segments that are the parts of the last message get the block-aligned layout
        (rag.prompt_layout); anything else is rendered and tokenized whole, its segments found
        in the text (`segment_regions`).
        """
        layout = lay_out(request, self.tokenizer, self.block_size, self.pad_token_id, self._encode)
        if layout is not None:
            return layout.token_ids, layout.regions
        text = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(t) for t in enc["input_ids"]]
        regions = segment_regions(text, enc.get("offset_mapping"), request.segments, request.base_namespace,
                                  fallback=request.user_salt)
        return ids, regions

    def cached_prefix(self, request: GenerationRequest) -> CachedPrefix:
        """What of `request`'s prompt the engine's prefix cache holds now, under its namespaces (read-only)."""
        layout = lay_out(request, self.tokenizer, self.block_size, self.pad_token_id, self._encode)
        if layout is None:
            ids, regions = self.prompt(request)
            return CachedPrefix(self.engine.engine.num_cached_prefix_tokens(ids, regions))
        cached = self.engine.engine.num_cached_prefix_tokens(layout.token_ids, layout.regions)
        return CachedPrefix(cached, layout.chunk_ends)

    def source_to_lead(self, request: GenerationRequest) -> int | None:
        """The source to place first so that its chunk KV is published by this request (rag.source_order).

        None unless the engine reuses chunks at any position (`kv_reuse="chunks"`) and the prompt
        lays out block-aligned; then the engine's `chunk_to_lead` (read-only).
        """
        laid_out = self._chunk_segments(request)
        if laid_out is None:
            return None
        segments = laid_out[1]
        chunks = [s for s in segments if s.kind.value == "chunk"]
        return self.engine.engine.chunk_to_lead(segments[0], chunks)

    def _chunk_segments(self, request: GenerationRequest) -> tuple[PromptLayout, list] | None:
        """The layout and the engine's segmented prompt of `request` when the engine reuses chunks.

        Only a block-aligned RAG layout is segmented: the engine reuses a chunk's KV only when the
        head and the chunk start on block boundaries; None for anything else.
        """
        if self.engine.engine.config.kv_reuse != "chunks":
            return None
        layout = lay_out(request, self.tokenizer, self.block_size, self.pad_token_id, self._encode)
        if layout is None or not layout.pieces:
            return None
        from generation.engine.prompt_segments import PromptSegment

        return layout, [PromptSegment.of(kind, layout.token_ids[start:end], namespace)
                        for kind, start, end, namespace in layout.pieces]

    def _engine_prompt(self, request: GenerationRequest) -> tuple[list[int], list[tuple[int, str | None]], list | None]:
        """Ids and regions, plus the segmented prompt when the engine reuses chunks at any position."""
        laid_out = self._chunk_segments(request)
        if laid_out is not None:
            layout, segments = laid_out
            return layout.token_ids, layout.regions, segments
        ids, regions = self.prompt(request)
        return ids, regions, None

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        from generation.sampling_params import SamplingParams

        if not self.engine.is_running:
            raise GeneratorUnavailable("the generation engine is not running")
        p = request.params
        params = SamplingParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens,
                                stop=list(p.stop), seed=p.seed)
        ids, regions, segments = self._engine_prompt(request)
        updates = (self.engine.generate_segmented_updates(segments, params) if segments is not None
                   else self.engine.generate_updates(ids, params, regions))
        async with contextlib.aclosing(updates) as stream:
            try:
                async for update in stream:
                    if update.text_delta:
                        yield TextDelta(update.text_delta)
                    if update.finished:
                        out, m = update.output, update.metrics
                        yield GenerationDone(
                            finish_reason=out.finish_reason if out else (update.finish_reason or "stop"),
                            prompt_tokens=len(ids), completion_tokens=len(out.token_ids) if out else 0,
                            time_to_first_token=m.time_to_first_token if m else None)
                        return
            except GenerationError as exc:
                if not self.engine.is_running:
                    raise GeneratorUnavailable(f"the generation engine stopped: {exc}") from exc
                raise

    async def aclose(self) -> None:
        self.engine.shutdown()


def segment_regions(text: str, offsets: Sequence[tuple[int, int]] | None, segments: Sequence[CacheSegment],
                    base_namespace: str, fallback: str | None) -> list[tuple[int, str | None]]:
    """Token-offset namespace regions for a rendered prompt.

    Each segment's text is looked up in the rendered prompt after the previous one; its region
    starts at the token holding the segment's first character, so a token that straddles the
    boundary goes to the later segment: segments only get more private along the prompt (the
    shared head, then sources by ACL, the user's part last), and user text never lands in a
    shared region.
    If a segment cannot be found, or the tokenizer gives no offsets, the whole prompt goes into
    the most private namespace (`fallback`, else the last segment's): fail closed, share nothing.
    """
    if not segments:
        return [(0, fallback if fallback is not None else base_namespace)]
    private = fallback if fallback is not None else segments[-1].namespace
    if not offsets:
        return [(0, private)]
    regions: list[tuple[int, str | None]] = [(0, base_namespace)]
    char_pos, token = 0, 0
    for segment in segments:
        at = text.find(segment.text, char_pos) if segment.text else -1
        if at < 0:
            log.warning("prompt segment not found in the rendered prompt: caching it privately")
            return [(0, private)]
        while token < len(offsets) and offsets[token][1] <= at:
            token += 1
        if token >= len(offsets):
            return [(0, private)]
        if token == regions[-1][0]:
            regions[-1] = (token, segment.namespace)
        elif segment.namespace != regions[-1][1]:
            regions.append((token, segment.namespace))
        char_pos = at + len(segment.text)
    return regions
