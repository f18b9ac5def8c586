"""Chat conversations → the question, the history to keep in the prompt, and what to retrieve with.

Retrieval uses the latest user turn; a short or referring follow-up ("and what about it?") is
searched together with the user turn before it, so "it"/"that" find the same documents.
Client system messages are not passed to the model: the service's own instructions (answer from
the sources, cite them) stay in charge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rag.errors import ConfigError

MAX_MESSAGES = 200
MAX_MESSAGE_CHARS = 16_000
HISTORY_MESSAGES = 6        # earlier turns kept in the prompt
HISTORY_CHARS = 800         # each, truncated
_REFERRING = re.compile(r"\b(it|its|that|this|those|these|they|them|their|there|he|she|one)\b", re.I)


@dataclass(frozen=True)
class Conversation:
    question: str
    history: list[dict[str, str]]
    retrieval_query: str


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts.

    Raises:
        ConfigError: content of another type, or parts that are not text.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ConfigError("message content parts must be {\"type\": \"text\", \"text\": ...}; "
                                  "images and files are not supported")
            texts.append(part["text"])
        return "\n".join(texts)
    if content is None:
        return ""
    raise ConfigError("message content must be a string or a list of text parts")


def parse_conversation(messages: Sequence[dict[str, Any]]) -> Conversation:
    """Split OpenAI chat messages into question, history and retrieval query.

    Raises:
        ConfigError: no messages, too many or too long, an unknown role, or no user turn last.
    """
    if not messages:
        raise ConfigError("messages must hold at least one user message")
    if len(messages) > MAX_MESSAGES:
        raise ConfigError(f"too many messages ({len(messages)}); at most {MAX_MESSAGES}")
    turns: list[dict[str, str]] = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ConfigError(f"unknown message role {role!r}; use system, user or assistant")
        text = message_text(m.get("content"))
        if len(text) > MAX_MESSAGE_CHARS:
            raise ConfigError(f"a message has {len(text)} characters; at most {MAX_MESSAGE_CHARS}")
        if role in ("user", "assistant") and text.strip():
            turns.append({"role": role, "content": text.strip()})
    if not turns or turns[-1]["role"] != "user":
        raise ConfigError("the last message must be a non-empty user message (the question)")
    question = turns[-1]["content"]
    history = [{"role": t["role"], "content": _truncate(t["content"])} for t in turns[:-1][-HISTORY_MESSAGES:]]
    return Conversation(question, history, retrieval_query_for(question, turns[:-1]))


def retrieval_query_for(question: str, history: Sequence[dict[str, str]]) -> str:
    """What to search with: `question`, or, for a short or referring follow-up, the user turn
    before it and the question ("Which microscope can I book? And how do I book it?")."""
    earlier_user = [t.get("content", "") for t in history if t.get("role") == "user" and t.get("content", "").strip()]
    if earlier_user and (len(question.split()) <= 8 or _REFERRING.search(question)):
        return f"{_truncate(earlier_user[-1].strip(), 300)} {question}"
    return question


def _truncate(text: str, limit: int = HISTORY_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
