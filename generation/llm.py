"""LLM: the offline generator facade (generate, chat, stream) over our own Llama implementation."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch

from generation.engine.model_runner import PaddedBatch
from generation.engine.sequence import Sequence
from generation.layers.sampler import sample
from generation.loader import load_model
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams
from rag.errors import GenerationError, ModelError

logger = logging.getLogger(__name__)

Message = dict[str, str]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LLM:
    """A local generator: loads a model folder once, then generates for batches of prompts.

    Args:
        model: a local Hugging Face model folder (config.json, *.safetensors, tokenizer files);
            see `generation.loader.resolve_model_dir` for defaults and GGUF files.
        device: "cuda", "cpu", ...; None picks CUDA when available.
        dtype: None gives bf16 on CUDA and fp32 on CPU.
        max_num_seqs: most sequences decoded together; larger lists run in several batches.

    Raises:
        ModelError: the folder is not a usable model, or the device is not available.
    """

    def __init__(
        self,
        model: str | Path,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        *,
        max_num_seqs: int = 16,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model_dir = Path(model).expanduser()
        if not self.model_dir.is_dir():
            raise ModelError(
                f"generator model folder {str(model)!r} does not exist. Pass a local Hugging Face "
                "model folder, or resolve a .gguf file or the default with "
                "generation.loader.resolve_model_dir first."
            )
        self.device = _pick_device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_num_seqs = max_num_seqs
        logger.info("loading generator %s on %s (%s)", self.model_dir, self.device, self.dtype)
        self.model, self.config = load_model(self.model_dir, self.device, self.dtype)
        self.tokenizer = _load_tokenizer(self.model_dir)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        Args:
            prompts: one string, a list of strings, or a list of token-id lists.
            params: one SamplingParams for all prompts, one per prompt, or None for greedy.

        Raises:
            GenerationError: an empty or over-long prompt, mismatched params, or text prompts /
                stop strings without a tokenizer.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            return []
        params_list = self._params_for(len(prompts), params)
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        # Similar lengths together: less padding to compute.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt_token_ids))
        for start in range(0, len(order), self.max_num_seqs):
            batch = [seqs[i] for i in order[start : start + self.max_num_seqs]]
            for _ in self._run(batch):
                pass
        return [seq.to_output() for seq in seqs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Answer one conversation (a list of messages) or several (a list of such lists).

        Returns:
            One RequestOutput for one conversation, a list for a list of conversations.
        """
        single = not messages or isinstance(messages[0], dict)
        conversations: list[list[Message]] = [messages] if single else messages  # type: ignore[list-item]
        outputs = self.generate([self.apply_chat_template(c) for c in conversations], params)
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

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are produced; never yields any part of a stop string.

        Raises:
            GenerationError: as generate(); streaming also needs a tokenizer.
        """
        self._require_tokenizer("stream")
        seq = self._make_sequence(prompt, params or SamplingParams())
        for _ in self._run([seq]):
            delta = seq.pop_stream_delta()
            if delta:
                yield delta

    def _run(self, seqs: list[Sequence]) -> Iterator[None]:
        """Prefill the batch, then decode one token per live sequence per step until all finish.

        Yields after every step so stream() can hand out text as it appears.
        """
        max_new = max(s.max_new_tokens for s in seqs)
        with torch.inference_mode():
            batch = PaddedBatch(self.model, [s.prompt_token_ids for s in seqs], max_new)
            logits = batch.prefill()
        live = list(seqs)
        while True:
            with torch.inference_mode():
                tokens = sample(logits, [s.params for s in live], [s.generator for s in live])
            for seq, token in zip(live, tokens.tolist(), strict=True):
                seq.append(token)
            yield
            keep = [i for i, s in enumerate(live) if not s.is_finished]
            if not keep:
                return
            with torch.inference_mode():
                if len(keep) < len(live):
                    batch.keep(keep)
                    tokens = tokens[keep]
                    live = [live[i] for i in keep]
                logits = batch.decode(tokens)

    def _make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer("text prompts")
            ids = [int(t) for t in tokenizer(prompt).input_ids]
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise GenerationError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("a prompt is empty: pass at least one token or character")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise GenerationError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        max_len = self.config.max_position_embeddings
        if len(ids) >= max_len:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens but the model's context is {max_len}: "
                "shorten it (fewer or smaller retrieved chunks)."
            )
        if params.stop and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer; this model folder has none")
        return Sequence(
            prompt_token_ids=ids,
            params=params,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_new_tokens=min(params.max_tokens, max_len - len(ids)),
            device=self.device,
        )

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


def _pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} was asked for but CUDA is not available: use 'cpu'")
    return dev


def _load_tokenizer(model_dir: Path) -> Any | None:
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        logger.info("%s has no tokenizer files: token-id prompts only", model_dir)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
