"""RequestOutput: what generate() returns for one prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request.

    Attributes:
        prompt_token_ids: the prompt as the model saw it.
        token_ids: generated tokens, including a final EOS/stop token when one ended generation.
        text: generated text, without special tokens and cut before a stop string.
        finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens or the
            model's context length).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
