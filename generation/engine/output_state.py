"""OutputState: one request's output while it is generated (tokens, text, stop checks, seeded generator)."""

from __future__ import annotations

from typing import Any

import torch

from generation.engine.detokenizer import IncrementalDetokenizer
from generation.outputs import RequestOutput
from generation.sampling_params import SamplingParams


class OutputState:
    """The output side of a request being generated: appends tokens, decides when it is finished and why.

    The scheduler's side of the same request (token ids, KV blocks, progress) is its `Sequence`;
    this holds what only the caller needs: the text so far, what of it has been streamed, the stop
    conditions, and the seeded random generator of its sampling.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any | None,
        eos_token_ids: set[int],
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        # params.max_tokens capped so that prompt + output fits the model's context: the same
        # limit as the request's Sequence.max_tokens, so both finish it at the same token.
        self.max_tokens = max_tokens
        stop_ids = set(params.stop_token_ids)
        self.stop_token_ids = stop_ids if params.ignore_eos else stop_ids | eos_token_ids
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.num_streamed_chars = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> None:
        """Record a sampled token and finish the output if it hits a stop condition."""
        assert not self.is_finished
        self.output_token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            # The stop token counts as generated but its text is not part of the answer.
            self._finish("stop")
            return
        if self.detokenizer is not None:
            self._add_text(self.detokenizer.add(token_id))
            if self.is_finished:
                return
        if len(self.output_token_ids) >= self.max_tokens:
            self._finish("length")

    def _add_text(self, delta: str) -> None:
        if not delta:
            return
        # Only the tail that the delta touched can hold a new match.
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.params.stop:
            return
        hits = [i for s in self.params.stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"  # no flush: text after a stop string is dropped anyway

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.detokenizer is not None:
            # A stop string completed by the flushed text turns the reason into "stop".
            self._add_text(self.detokenizer.flush())

    def pop_stream_delta(self) -> str:
        """Text not yet streamed that can no longer turn into a stop string."""
        end = len(self.text)
        if not self.is_finished:
            end -= self._stop_prefix_len()
        delta = self.text[self.num_streamed_chars : end]
        self.num_streamed_chars = max(self.num_streamed_chars, end)
        return delta

    def _stop_prefix_len(self) -> int:
        # Length of the longest tail of the text that is the start of some stop string: it might
        # still become that stop string, so it must not be shown yet.
        longest = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def to_output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
        )
