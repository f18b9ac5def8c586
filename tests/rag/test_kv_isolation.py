"""Whose cached KV a RAG prompt may reuse, by the engine's prefix-cache hit counters (never timings).

Real parts: the pipeline's namespaces (`Rag.cache_segments`, `Rag.user_salt`), the block-aligned
layout, LocalGenerator and the engine with a tiny random Llama on the CPU. A chunk's KV is shared
by principals whose prompts hold it under the same ACL; nobody else reaches it, and changing the
chunk's text or its ACL leaves the old blocks unreachable.
"""

from __future__ import annotations

from dataclasses import replace

from permissions.models import Principal
from rag.generator import GenerationParams, GenerationRequest
from rag.pipeline import Rag
from rag.prompt_layout import PromptLayout, lay_out
from rag.prompts import build_prompt
from rag.types import Hit
from tests.rag import tiny_engine
from tests.rag.tiny_engine import generate, hit_tokens

BS = 8

# The tiny engine's fixtures, shared with the other tests of the service's prompt layout.
generator = tiny_engine.generator
model_dir = tiny_engine.model_dir
rag = tiny_engine.rag
ALICE = Principal("alice", frozenset({"genomics"}))
ERIN = Principal("erin", frozenset({"genomics"}))
DAVE = Principal("dave")
BOB = Principal("bob", frozenset({"imaging"}))

GPU = "Partition gpu holds nodes gpu01 to gpu08; ask before using gpu08."
SHARE = "The genomics share is /data/genomics, backed up nightly."


def hit(key: str, text: str, *acl: str) -> Hit:
    return Hit(chunk_id=sum(map(ord, key + text)), document_key=key, source=f"/d/{key}", chunk_index=0,
               text=text, score=1.0, title=key, acl=frozenset(acl))


X = hit("x.md", GPU, "group:genomics")
Z = hit("z.md", SHARE, "group:genomics")


def request(rag: Rag, principal: Principal, question: str, sources: list[Hit]) -> GenerationRequest:
    prompt = build_prompt(question, sources)
    return GenerationRequest(prompt.messages, GenerationParams(max_tokens=2),
                             segments=rag.cache_segments(prompt, sources, principal),
                             user_salt=rag.user_salt(principal))


def layout_of(generator, req: GenerationRequest) -> PromptLayout:
    out = lay_out(req, generator.tokenizer, generator.block_size, generator.pad_token_id)
    assert out is not None
    return out


def hits_of(generator, req: GenerationRequest) -> int:
    """Prompt tokens this request took from the cache (the engine's counter, before and after)."""
    before = hit_tokens(generator)
    probed = generator.cached_prefix(req).num_tokens
    generate(generator, req)
    assert hit_tokens(generator) - before == probed  # the read-only probe foretold the hits
    return probed


def head_blocks(out: PromptLayout) -> int:
    """Tokens of the full blocks before the first source's label: what everyone shares."""
    return out.regions[1][0] // BS * BS


def test_the_same_chunks_under_the_same_acl_are_reused_across_users(rag, generator):
    assert hits_of(generator, request(rag, ALICE, "Which GPU nodes can I use?", [X, Z])) == 0
    erin = request(rag, ERIN, "Where is the genomics share?", [X, Z])
    out = layout_of(generator, erin)
    # Head, both labels and both chunks; not a block of Erin's question.
    assert hits_of(generator, erin) == out.chunk_ends[-1] > head_blocks(out)
    # Another member asking Alice's very question: still no block of the question is Alice's.
    fred = Principal("fred", frozenset({"genomics"}))
    assert hits_of(generator, request(rag, fred, "Which GPU nodes can I use?", [X, Z])) == out.chunk_ends[-1]


def test_a_principal_without_the_group_never_hits_its_chunk_kv(rag, generator):
    alice = request(rag, ALICE, "Which GPU nodes can I use?", [X, Z])
    hits_of(generator, alice)
    # The same text reaches Dave only from a document he may read (a public copy), and Bob only
    # from one of his group's: the very same token ids under other ACLs, so only the head is reused.
    for principal, acl in ((DAVE, "public"), (BOB, "group:imaging")):
        copies = [replace(h, document_key=f"copy-of-{h.document_key}", acl=frozenset({acl})) for h in (X, Z)]
        req = request(rag, principal, "Which GPU nodes can I use?", copies)
        out = layout_of(generator, req)
        assert out.token_ids == layout_of(generator, alice).token_ids
        assert hits_of(generator, req) == head_blocks(out)


def test_changing_a_chunks_text_leaves_its_old_kv_unreachable(rag, generator):
    hits_of(generator, request(rag, ALICE, "Which GPU nodes can I use?", [X, Z]))
    edited = hit("x.md", GPU.replace("Partition", "Queue"), "group:genomics")
    req = request(rag, ERIN, "Which GPU nodes can I use?", [edited, Z])
    out = layout_of(generator, req)
    # The label before it is unchanged and still shared; the chunk (and all after it) is not.
    assert hits_of(generator, req) == out.chunk_spans[0][0]


def test_changing_a_documents_acl_leaves_its_old_kv_unreachable(rag, generator):
    hits_of(generator, request(rag, ALICE, "Which GPU nodes can I use?", [X, Z]))
    widened = replace(X, acl=frozenset({"group:genomics", "group:imaging"}))
    req = request(rag, ALICE, "Which GPU nodes can I use?", [widened, Z])
    out = layout_of(generator, req)
    assert hits_of(generator, req) == head_blocks(out)
