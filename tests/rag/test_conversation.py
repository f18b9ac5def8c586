"""Follow-ups are searched with the turn before them, in the chat API and in the Python API alike."""

from __future__ import annotations

import pytest

from permissions.models import Principal
from rag.conversation import parse_conversation, retrieval_query_for
from rag.errors import ConfigError

FIRST = "Which microscope can I book?"
HISTORY = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "KRIOS-2 [1]."}]


def test_a_short_or_referring_follow_up_is_searched_with_the_user_turn_before_it():
    assert retrieval_query_for("And how do I book it?", HISTORY) == f"{FIRST} And how do I book it?"
    long_referring = "Could you tell me in detail which training sessions are needed for that one"
    assert retrieval_query_for(long_referring, HISTORY) == f"{FIRST} {long_referring}"
    standalone = "What is the storage quota on the scratch file system for new accounts"
    assert retrieval_query_for(standalone, HISTORY) == standalone  # long and not referring
    assert retrieval_query_for("And how?", []) == "And how?"  # nothing before it
    assert retrieval_query_for("And how?", [{"role": "assistant", "content": "x"}]) == "And how?"


def test_the_chat_api_and_the_python_api_agree():
    messages = [*HISTORY, {"role": "user", "content": "And how do I book it?"}]
    conversation = parse_conversation(messages)
    assert conversation.retrieval_query == retrieval_query_for("And how do I book it?", HISTORY)
    with pytest.raises(ConfigError, match="last message"):
        parse_conversation(HISTORY)


@pytest.mark.slow
def test_rag_query_with_history_searches_the_follow_up_in_context(lab_rag):
    bob = Principal("bob", frozenset({"imaging"}))

    def hits(**kwargs):
        prepared = lab_rag.prepare("And how do I book it?", bob, generate=False, **kwargs)
        return [(h.chunk_id, round(h.score, 4)) for h in prepared.answer.hits]

    in_context = hits(history=HISTORY)
    assert in_context == hits(retrieval_query=f"{FIRST} And how do I book it?")
    assert in_context != hits()  # alone, "it" finds nothing in particular
    answer = lab_rag.query("And how do I book it?", bob, history=HISTORY)
    assert answer.citations and any("cryoem-booking" in c.source for c in answer.citations)
