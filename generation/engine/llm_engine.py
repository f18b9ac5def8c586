"""LLMEngine: requests in, one scheduled model step at a time, per-request token and text updates out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generation.config import EngineConfig
from generation.engine.block_manager import BlockManager
from generation.engine.cache_namespaces import CacheNamespaces, NamespaceSpec
from generation.engine.chunk_doorkeeper import ChunkDoorkeeper
from generation.engine.chunk_reuse import ChunkReusePlanner, compile_prompt
from generation.engine.detokenizer import PROMPT_CONTEXT_TOKENS
from generation.engine.host_kv_tier import HostKVTier
from generation.engine.metrics import EngineMetrics, MetricsSnapshot, RequestMetrics
from generation.engine.model_runner import ModelRunner
from generation.engine.output_state import OutputState
from generation.engine.prompt_segments import (
    PromptSegment,
    SegmentKind,
    check_segments,
    namespace_regions,
    prompt_token_ids,
)
from generation.engine.scheduler import Scheduler, SchedulerConfig
from generation.engine.sequence import Sequence, SequenceStatus
from generation.layers.rerotation import check_rerotatable
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams
from rag.errors import GenerationError, ModelError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did for one request.

    Attributes:
        request_id: as add_request returned it.
        new_token_ids: tokens this step produced for the request (one per model step of the batch,
            up to its stop; a final stop token included).
        text_delta: new text that can no longer turn into a stop string ("" for requests added
            with incremental_text=False, whose text comes only with the output).
        finished: the request is done and its KV blocks are released.
        finish_reason: "stop" or "length" when finished, else None.
        output: the whole result, when finished.
        metrics: the request's latencies, when finished.
    """

    request_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None
    metrics: RequestMetrics | None = None


class Request:
    """One request inside the engine: its Sequence for the scheduler, its OutputState for stop checks and text.

    An internal request (a chunk compile) has no caller: it produces no updates or metrics.
    """

    __slots__ = ("seq", "output_state", "incremental_text", "internal")

    def __init__(self, seq: Sequence, output_state: OutputState, incremental_text: bool) -> None:
        self.seq = seq
        self.output_state = output_state
        self.incremental_text = incremental_text
        self.internal = False

    @property
    def request_id(self) -> int:
        return self.seq.seq_id


class LLMEngine:
    """Continuous-batching generation over a paged KV cache with a namespaced prefix cache.

    Not thread-safe: one thread calls add/abort/step (AsyncLLMEngine runs it on its own thread).

    Args:
        model: a local Hugging Face model folder.
        config: engine settings; defaults when None.

    Raises:
        ModelError: the folder is not a usable model, the device is missing, or the KV cache
            cannot hold one sequence of max_model_len.
    """

    def __init__(self, model: str | Path, config: EngineConfig | None = None) -> None:
        self.model_dir = Path(model).expanduser()
        if not self.model_dir.is_dir():
            raise ModelError(
                f"generator model folder {str(model)!r} does not exist. Pass a local Hugging Face "
                "model folder, or resolve a .gguf file or the default with "
                "generation.loader.resolve_model_dir first."
            )
        self.config = config or EngineConfig()
        self.model_runner = ModelRunner(self.model_dir, self.config)
        self.model_config = self.model_runner.model_config
        self.max_model_len = self.model_runner.max_model_len
        self.tokenizer = load_tokenizer(self.model_dir)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        host_kv = self.model_runner.host_kv
        host_tier = None
        if host_kv is not None:
            host_tier = HostKVTier(self.config.host_kv_blocks, host_kv, self.config.host_kv_admit_uses)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            host_tier,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
            num_scheduler_steps=self.model_runner.num_scheduler_steps,
        )
        self.chunk_planner: ChunkReusePlanner | None = None
        if self.config.kv_reuse == "chunks":
            try:
                check_rerotatable(self.model_config.rope_scaling)
            except ValueError as exc:
                raise ModelError(f"{self.model_dir}: {exc}") from exc
            self.chunk_planner = ChunkReusePlanner(self.block_manager, self.config.chunk_recompute_choice())
        self.scheduler = Scheduler(scheduler_config, self.block_manager, self.chunk_planner)
        self.metrics = EngineMetrics()
        self._requests: dict[int, Request] = {}
        # Chunk compiles queued and not finished yet, by what they compute: one per chunk at a time.
        self._compiles: dict[tuple, int] = {}
        # chunk_miss="in_place": which missed chunks are worth a compile (None: "wait" compiles every miss).
        in_place = self.chunk_planner is not None and self.config.chunk_miss == "in_place"
        self._doorkeeper = ChunkDoorkeeper() if in_place else None

    # ---------------------------------------------------------------------------------------------
    # Requests
    # ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        namespace: NamespaceSpec = None,
        *,
        incremental_text: bool = True,
    ) -> int:
        """Queue a request; returns its id.

        Args:
            prompt: token ids, or text (tokenized with the model's tokenizer).
            params: sampling and stopping; greedy with defaults when None.
            namespace: prefix-cache domain: KV blocks are shared only between requests of the
                same namespace (None is a namespace of its own). Or `(token_offset, namespace)`
                regions (`generation.engine.cache_namespaces.NamespaceRegions`) for a prompt whose
                segments have different domains, e.g. `[(0, "sys"), (40, "acl:lab-a"), (90,
                "user:ana")]`: the first offset 0, offsets strictly increasing and inside the
                prompt's token ids, generated tokens in the last region. A block is shared only
                when every region covering it and every block before it agree.
            incremental_text: produce text deltas every step; False leaves them empty and
                decodes the text once at the end (cheaper, for offline batches).

        Raises:
            GenerationError: an empty, over-long or out-of-vocabulary prompt, malformed namespace
                regions, or text / stop strings without a tokenizer.
        """
        return self.add(self.make_request(prompt, params, namespace, incremental_text=incremental_text))

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        namespace: NamespaceSpec = None,
        *,
        incremental_text: bool = True,
    ) -> Request:
        """Validate and build a request without queueing it (safe from any thread); see add_request."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        if params.stop and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer; this model folder has none")
        try:
            namespaces = CacheNamespaces.of(namespace, len(ids))
        except ValueError as exc:
            raise GenerationError(f"bad prefix-cache namespace for a {len(ids)}-token prompt: {exc}") from exc
        max_new = min(params.max_tokens, self.max_model_len - len(ids))
        seq = Sequence(ids, max_tokens=max_new, namespace=namespaces)
        # Without incremental text and stop strings no detokenizer runs per token (it costs two
        # tokenizer calls per token); the text is decoded once when the request finishes.
        detokenize = incremental_text or bool(params.stop)
        output_state = OutputState(
            prompt_token_ids=ids,
            params=params,
            tokenizer=self.tokenizer if detokenize else None,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_new,
            device=self.model_runner.device,
        )
        return Request(seq, output_state, incremental_text)

    def add(self, request: Request) -> int:
        """Queue a request built by make_request or make_segmented_request; returns its id."""
        seq = request.seq
        behind: list[tuple[PromptSegment, PromptSegment]] = []
        if self.block_manager.host_tier is not None:
            # Blocks of its exact prefix that the host tier holds start coming back now, beside the
            # steps the request queues behind (admission restores what is evicted meanwhile).
            self.block_manager.restore_from_host(seq)
        if seq.segments is not None and self.chunk_planner is not None:
            head = seq.segments[0]
            for position, chunk in enumerate(seq.segments):
                if chunk.kind is not SegmentKind.CHUNK or self.chunk_planner.lookup(head, chunk):
                    continue
                if position == 1:
                    # Right after the head, the request's own prefill of the chunk *is* its canonical
                    # chain `head ‖ chunk` (same tokens, positions and namespaces), published as it
                    # is computed: a compile would only compute it again.
                    continue
                if self._doorkeeper is None:
                    # chunk_miss="wait": the compile goes first and the request waits for it.
                    seq.waits_for.add(self._compile(head, chunk))
                elif self._doorkeeper.on_miss(head, chunk):
                    behind.append((head, chunk))  # "in_place": computed here, compiled for later requests
        self.scheduler.add(request.seq)
        self._requests[request.request_id] = request
        if not request.internal:
            self.metrics.on_arrival(request.request_id, request.seq.arrival_time)
        for head, chunk in behind:
            # Queued after the request, so it never delays it: the request computes the chunk in place.
            self._compile(head, chunk)
        return request.request_id

    def add_segmented_request(
        self,
        segments: SequenceABC[PromptSegment],
        params: SamplingParams | None = None,
        *,
        incremental_text: bool = True,
    ) -> int:
        """Queue a prompt given as segments (head, labels and chunks, suffix); returns its id.

        The prompt is the segments' token ids concatenated, each segment in its own prefix-cache
        namespace. With `kv_reuse="exact"` that is all: full-prefill results, exact prefix hits.
        With `kv_reuse="chunks"` each chunk's KV comes from its canonical chain `head ‖ chunk`
        (computed first, standalone, when the cache lacks it; the request waits for it) at any
        position, re-rotated, and the labels, each reused chunk's first block (or fraction) and
        the suffix are recomputed. A chunk is reused only under its own namespace, head and exact
        token ids; reuse needs the head and the chunk to start on KV block boundaries (a chunk
        that does not is computed in place).

        Raises:
            GenerationError: malformed segments, or the prompt is invalid as in add_request.
        """
        return self.add(self.make_segmented_request(segments, params, incremental_text=incremental_text))

    def make_segmented_request(
        self,
        segments: SequenceABC[PromptSegment],
        params: SamplingParams | None = None,
        *,
        incremental_text: bool = True,
    ) -> Request:
        """Validate and build a segmented request without queueing it (safe from any thread).

        The chunk lookups (and compiles) happen in `add`, on the stepping thread.
        """
        try:
            segments = tuple(segments)
            check_segments(segments)
        except (ValueError, TypeError, AttributeError) as exc:
            raise GenerationError(f"bad prompt segments: {exc}") from exc
        request = self.make_request(
            prompt_token_ids(segments), params, namespace_regions(segments), incremental_text=incremental_text
        )
        if self.chunk_planner is not None:
            request.seq.segments = segments
        return request

    def _compile(self, head: PromptSegment, chunk: PromptSegment) -> int:
        """Queue (once) the prefill of `head ‖ chunk` that publishes the chunk's canonical KV; its id."""
        key = (head.namespace, head.token_ids, chunk.namespace, chunk.token_ids)
        pending = self._compiles.get(key)
        if pending is not None and pending in self._requests:
            return pending
        ids, regions = compile_prompt(head, chunk)
        request = self.make_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), regions, incremental_text=False)
        request.internal = True
        request.seq.published_block_uses = 1  # demand the chunk doorkeeper saw (host tier admission)
        self._compiles[key] = self.add(request)
        return request.request_id

    def abort(self, request_id: int) -> bool:
        """Drop a request and free its KV blocks; False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        self.metrics.on_abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def get_metrics(self) -> MetricsSnapshot:
        return self.metrics.snapshot(self.scheduler)

    def chunk_to_lead(self, head: PromptSegment, chunks: SequenceABC[PromptSegment]) -> int | None:
        """Which of a prompt's chunks should come right after the head, so that computing it costs no compile.

        With `kv_reuse="chunks"` a chunk placed right after the head is computed as its own
        canonical chain `head ‖ chunk` and published by the request itself, whereas a missed chunk
        anywhere else costs more: with `chunk_miss="in_place"` it is computed in place and, if it
        missed before, compiled once more; with "wait" it is compiled first and the request waits.
        So the chunk to lead with is a missed one: with "in_place" the first (in the given order,
        e.g. by rank) that missed before, which is likely to be retrieved again (a chunk missed
        for the first time is usually one of the many cold ones, and leading with it would move
        a cached chunk out of the exact prefix it would have there); with "wait" the first missed.
        None when there is no such chunk or the engine does not reuse chunks: then the caller's
        order stands (the exact prefix cache's order, in the service).

        Read-only like `num_cached_prefix_tokens`: nothing is counted, referenced or copied back.

        Args:
            head: the prompt's head segment (everything before its first chunk).
            chunks: the prompt's chunk segments, in the caller's preferred order.
        """
        if self.chunk_planner is None:
            return None
        missed = [i for i, chunk in enumerate(chunks) if not self.chunk_planner.is_cached(head, chunk)]
        if self._doorkeeper is None:
            return missed[0] if missed else None
        return next((i for i in missed if self._doorkeeper.has_missed(head, chunks[i])), None)

    def num_cached_prefix_tokens(self, token_ids: list[int], namespace: NamespaceSpec = None) -> int:
        """Leading tokens of `token_ids` whose KV the prefix cache holds now under `namespace` (whole blocks).

        Blocks the host KV tier holds count too: admission copies them back instead of computing
        them. Either way a block counts only under the exact namespace, prefix and tokens.

        Read-only: no reference count, LRU position or hit counter changes, so a caller can probe
        several candidate prompts (orders of retrieved sources) and submit one. It only reads
        the cache's maps, so another thread than the stepping one may call it; the answer can be
        stale by the time a request is added.

        Raises:
            ValueError: malformed namespace regions (see CacheNamespaces.of).
        """
        if not token_ids:
            return 0
        # One token more: the block holding a prompt's last token is never taken from the cache,
        # and here every full block of token_ids counts.
        probe = Sequence([*token_ids, 0], max_tokens=1, namespace=namespace)
        return self.block_manager.num_restorable_prefix_tokens(probe)

    # ---------------------------------------------------------------------------------------------
    # A step
    # ---------------------------------------------------------------------------------------------

    def step(self, arrived: Callable[[], bool] | None = None) -> list[RequestUpdate]:
        """Schedule a batch, run its model step(s) and account for them; one update per request that sampled.

        A batch of several steps (EngineConfig.num_scheduler_steps) gives each request the tokens
        of all its steps up to its stop at once. Each step's tokens are checked for stops while
        the device runs the step after it.

        Args:
            arrived: the caller's "a new request is ready to be added", asked between the steps
                of a multi-step batch. When it says so and the batch has room for another
                sequence, the batch ends after the steps already launched, so that the caller
                adds the request and the next step prefills it: it waits a step or two instead
                of up to num_scheduler_steps (without it, a batch of 8 decode steps made a new
                request's time to first token at least that long under load).

        Raises:
            GenerationError: a request needs more KV blocks than the whole cache has.
        """
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        requests = [self._requests[e.seq.seq_id] for e in batch.sampling_entries]
        kept: list[list[int]] = [[] for _ in requests]
        live = list(range(len(requests)))
        stop_early = None
        if arrived is not None and batch.num_steps > 1 and self.scheduler.num_running < self.config.max_num_seqs:
            stop_early = arrived
        steps = self.model_runner.execute(
            batch,
            [r.output_state.params for r in requests],
            [r.output_state.generator for r in requests],
            stop_early,
        )
        on_token = self.metrics.on_token
        num_run = 0
        for tokens in steps:  # internal requests have no arrival, so on_token ignores them
            num_run += 1
            now = time.monotonic()
            still: list[int] = []
            for row in live:
                request, token = requests[row], tokens[row]
                output_state = request.output_state
                output_state.append(token)
                kept[row].append(token)
                on_token(request.request_id, now)
                if not output_state.is_finished:
                    still.append(row)
            live = still
            if not live:
                break  # every request stopped: nothing more is launched
        if live and num_run < batch.num_steps:
            # Requests still live and steps left: the batch stopped for an arrival.
            self.metrics.num_batches_stopped_early += 1
            self.metrics.num_steps_skipped += batch.num_steps - num_run
        sampled: dict[int, list[int]] = {}
        for request, tokens in zip(requests, kept, strict=True):
            # The scheduler frees a sequence whose stop logic (EOS, stop strings) finished it.
            request.seq.finished = request.output_state.is_finished
            sampled[request.request_id] = tokens
        self.scheduler.postprocess(batch, sampled)
        updates = [self._update(request, tokens) for request, tokens in zip(requests, kept, strict=True)]
        return [u for u, r in zip(updates, requests, strict=True) if not r.internal]

    def _update(self, request: Request, tokens: list[int]) -> RequestUpdate:
        output_state = request.output_state
        finished = request.seq.status is SequenceStatus.FINISHED
        # Both cap the output at min(max_tokens, max_model_len - prompt), so they agree on "length".
        assert finished == output_state.is_finished, (
            f"scheduler and stop logic disagree on request {request.request_id}"
        )
        delta = output_state.pop_stream_delta() if request.incremental_text else ""
        if not finished:
            return RequestUpdate(request.request_id, tokens, delta, False)
        del self._requests[request.request_id]
        if request.internal:
            self._compiles = {k: v for k, v in self._compiles.items() if v != request.request_id}
            return RequestUpdate(request.request_id, tokens, delta, True)
        if output_state.detokenizer is None and self.tokenizer is not None:
            output_state.text = self._decode_output(output_state)
        return RequestUpdate(
            request.request_id,
            tokens,
            delta,
            True,
            output_state.finish_reason,
            output_state.to_output(),
            self.metrics.on_finish(request.request_id),
        )

    def _decode_output(self, output_state: OutputState) -> str:
        """The text the incremental detokenizer would have produced, decoded in one call."""
        ids = output_state.output_token_ids
        if output_state.finish_reason == "stop" and ids and ids[-1] in output_state.stop_token_ids:
            ids = ids[:-1]  # a stop token counts as generated, but its text is not part of the answer
        # The same prompt context as the incremental detokenizer, so a leading space survives.
        context = output_state.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        kwargs = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
        assert self.tokenizer is not None
        return self.tokenizer.decode(context + ids, **kwargs)[len(self.tokenizer.decode(context, **kwargs)) :]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GenerationError(
                    f"text prompts need a tokenizer, and {self.model_dir} has no tokenizer files: pass token "
                    "ids, or use a model folder saved with its tokenizer."
                )
            ids = [int(t) for t in self.tokenizer(prompt).input_ids]
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise GenerationError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("a prompt is empty: pass at least one token or character")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise GenerationError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_model_len:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                "(max_model_len, prompt + output): shorten it (fewer or smaller retrieved chunks)."
            )
        return ids


def load_tokenizer(model_dir: Path) -> Any | None:
    """The folder's tokenizer, or None when it has no tokenizer files.

    Raises:
        ModelError: tokenizer files that do not load.
    """
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        logger.info("%s has no tokenizer files: token-id prompts only", model_dir)
        return None
    from transformers import AutoTokenizer

    from rag.quiet import quiet_libraries

    try:
        with quiet_libraries():  # a notebook's own transformers level stays as it was, and quiet here
            return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
