"""Incremental detokenisation: text deltas that are right even when a character spans tokens."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded ahead of the output: tokenizers that drop a word's leading space at the
# start of a decode (SentencePiece) then keep it for the first output word.
PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window ending at the newest token and emits what the window adds beyond
    the previously emitted tokens' text. A window whose text ends in U+FFFD (a UTF-8 character
    cut between byte tokens) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0  # window start
        self.read_offset = len(context)  # tokens before this are already emitted

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be "")."""
        self.token_ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character comes out as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token: nothing visible yet
        if new_text.endswith("\ufffd") and not final:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites text across window boundaries (" ." -> "."), so deltas would
        # not concatenate to the full decode.
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
