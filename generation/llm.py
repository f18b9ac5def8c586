"""LLM: the offline generator facade (generate, chat, stream) over the paged continuous-batching engine."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from generation.config import EngineConfig, ModelConfig
from generation.engine.cache_namespaces import NamespaceSpec
from generation.engine.llm_engine import LLMEngine
from generation.engine.metrics import MetricsSnapshot
from generation.engine.prompt_segments import PromptSegment
from generation.models.llama import LlamaForCausalLM
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams
from rag.errors import GenerationError
from rag.quiet import quiet_libraries

logger = logging.getLogger(__name__)

Message = dict[str, str]


class LLM:
    """A local generator: loads a model folder once, then generates for batches of prompts.

    Not thread-safe (one generate/stream at a time); for concurrent requests use
    `generation.engine.async_engine.AsyncLLMEngine`.

    Args:
        model: a local Hugging Face model folder (config.json, *.safetensors, tokenizer files);
            see `generation.loader.resolve_model_dir` for defaults and GGUF files.
        device: "cuda", "cpu", ...; None picks CUDA when available.
        dtype: None gives bf16 on CUDA and fp32 on CPU.
        config: engine settings (batch limits, KV cache, CUDA graphs); defaults when None.
        **engine_args: EngineConfig fields that override `config` (max_num_seqs=..., num_kv_blocks=...).

    Raises:
        ModelError: the folder is not a usable model, the device is not available, or the KV
            cache cannot hold one sequence of max_model_len.
        ValueError: an engine setting out of range.
    """

    def __init__(
        self,
        model: str | Path,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        *,
        config: EngineConfig | None = None,
        **engine_args: Any,
    ) -> None:
        config = config or EngineConfig()
        overrides = {k: v for k, v in {"device": device, "dtype": dtype}.items() if v is not None}
        config = dataclasses.replace(config, **overrides, **engine_args)
        self.model_dir = Path(model).expanduser()
        logger.info("loading generator %s", self.model_dir)
        with quiet_libraries():  # the engine loads a transformers tokenizer
            self.engine = LLMEngine(self.model_dir, config)
        runner = self.engine.model_runner
        self.device: torch.device = runner.device
        self.dtype: torch.dtype = runner.dtype
        self.model: LlamaForCausalLM = runner.model
        self.config: ModelConfig = runner.model_config
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = self.engine.eos_token_ids

    def metrics(self) -> MetricsSnapshot:
        """Queue lengths, KV blocks, prefix-cache hits and latencies of the engine."""
        return self.engine.get_metrics()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        namespace: NamespaceSpec = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, all batched together; outputs come back in the order of the prompts.

        Args:
            prompts: one string, a list of strings, or a list of token-id lists.
            params: one SamplingParams for all prompts, one per prompt, or None for greedy.
            namespace: prefix-cache domain of these requests (KV is shared only within one), or
                `(token_offset, namespace)` regions applied to every prompt's token ids (see
                LLMEngine.add_request); regions must fit the shortest prompt.

        Raises:
            GenerationError: an empty or over-long prompt, mismatched params, or text prompts /
                stop strings without a tokenizer.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        params_list = self._params_for(len(prompts), params)
        # Build (and so validate) every request before queueing any: a bad prompt leaves no work behind.
        requests = [
            self.engine.make_request(p, sp, namespace, incremental_text=False)
            for p, sp in zip(prompts, params_list, strict=True)
        ]
        ids = [self.engine.add(r) for r in requests]
        return self._run_to_completion(ids)

    def generate_segmented(
        self,
        prompts: list[list[PromptSegment]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for prompts given as segments (LLMEngine.add_segmented_request), batched together.

        With the engine's kv_reuse="chunks" the chunks' KV is reused across positions and
        prompts; with "exact" this equals generate() on the concatenated ids and regions.
        """
        if not prompts:
            return []
        params_list = self._params_for(len(prompts), params)
        ids = [
            self.engine.add_segmented_request(p, sp, incremental_text=False)
            for p, sp in zip(prompts, params_list, strict=True)
        ]
        return self._run_to_completion(ids)

    def _run_to_completion(self, ids: list[int]) -> list[RequestOutput]:
        """Step the engine until every request in `ids` is done; abort the rest if stepping fails."""
        outputs: dict[int, RequestOutput] = {}
        try:
            while len(outputs) < len(ids):
                for update in self.engine.step():
                    if update.output is not None:
                        outputs[update.request_id] = update.output
        finally:
            for request_id in ids:
                if request_id not in outputs:
                    self.engine.abort(request_id)
        return [outputs[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
        namespace: NamespaceSpec = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Answer one conversation (a list of messages) or several (a list of such lists).

        `namespace` as in generate(); region offsets count the templated token ids
        (apply_chat_template).

        Returns:
            One RequestOutput for one conversation, a list for a list of conversations.
        """
        single = not messages or isinstance(messages[0], dict)
        conversations: list[list[Message]] = [messages] if single else messages  # type: ignore[list-item]
        outputs = self.generate([self.apply_chat_template(c) for c in conversations], params, namespace)
        return outputs[0] if single else outputs

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Token ids of a conversation in the model's chat format, ending with the assistant cue.

        Raises:
            GenerationError: no tokenizer, or a tokenizer without a chat template.
        """
        tokenizer = self._require_tokenizer("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise GenerationError(
                f"the tokenizer of {self.model_dir} has no chat template: use generate() with a "
                "formatted prompt, or use an instruct model."
            )
        ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        # transformers versions differ in what tokenize=True returns.
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, namespace: NamespaceSpec = None
    ) -> Iterator[str]:
        """Yield text deltas as tokens are produced; never yields any part of a stop string.

        Closing the iterator early aborts the request and frees its KV blocks. `namespace` as in
        generate().

        Raises:
            GenerationError: as generate(); streaming also needs a tokenizer.
        """
        self._require_tokenizer("stream")
        request_id = self.engine.add_request(prompt, params or SamplingParams(), namespace)
        finished = False
        try:
            while not finished:
                for update in self.engine.step():
                    if update.request_id != request_id:
                        continue
                    finished = update.finished
                    if update.text_delta:
                        yield update.text_delta
        finally:
            if not finished:
                self.engine.abort(request_id)

    @staticmethod
    def _params_for(n: int, params: SamplingParams | list[SamplingParams] | None) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise GenerationError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
        return list(params)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise GenerationError(
                f"{what} need a tokenizer, and {self.model_dir} has no tokenizer files: pass token "
                "ids, or use a model folder saved with its tokenizer."
            )
        return self.tokenizer
