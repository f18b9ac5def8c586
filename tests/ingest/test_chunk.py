"""Chunking with the embedder's real tokenizer: the cap, headings, overlap, and no text lost."""

from __future__ import annotations

import random
import re

import pytest

from ingest.chunk import Chunker, ChunkingConfig
from rag.types import Chunk, Document, Element


def doc(*elements: Element, title: str | None = None, key: str = "k") -> Document:
    return Document(key=key, source="s", text="\n\n".join(e.text for e in elements),
                    content_hash="h", acl=None, title=title, elements=tuple(elements))


def T(text: str) -> Element:  # noqa: N802 -- reads like the element kind
    return Element("Title", text)


def P(text: str, page: int | None = None) -> Element:  # noqa: N802
    return Element("NarrativeText", text, page)


def body(chunk: Chunk) -> str:
    """The chunk's text without its heading prefix."""
    head, sep, rest = chunk.text.partition("\n\n")
    return rest if sep and chunk.heading and head.splitlines()[-1] == chunk.heading else chunk.text


@pytest.fixture(scope="module")
def chunker(tokenizer) -> Chunker:
    return Chunker(tokenizer, ChunkingConfig(max_tokens=48, overlap_tokens=8))


# --------------------------------------------------------------------------------- config


def test_config_defaults_and_validation() -> None:
    assert ChunkingConfig() == ChunkingConfig(max_tokens=200, overlap_tokens=32)
    ChunkingConfig(max_tokens=16, overlap_tokens=7)
    with pytest.raises(ValueError, match=">= 16"):
        ChunkingConfig(max_tokens=15)
    with pytest.raises(ValueError, match=r"0\.\.7 for max_tokens=16"):
        ChunkingConfig(max_tokens=16, overlap_tokens=8)
    with pytest.raises(ValueError, match="overlap_tokens"):
        ChunkingConfig(overlap_tokens=-1)


def test_count_tokens_has_no_special_tokens_and_no_truncation(tokenizer, chunker) -> None:
    assert chunker.count_tokens("hello world") == 2
    long = " ".join(["word"] * 1000)
    # tokenizer.json of MiniLM truncates at 128: the chunker must see the real length.
    assert chunker.count_tokens(long) == 1000
    assert chunker.count_tokens(long) == len(tokenizer(long, add_special_tokens=False)
                                             ["input_ids"])


# ------------------------------------------------------------------------------- headings


def test_sections_packing_and_headings(chunker) -> None:
    d = doc(T("Storage"), P("Home has a quota."), P("Scratch is purged."),
            T("Jobs"), P("Use sbatch to submit."), title="Guide")
    chunks = chunker.chunk(d)
    assert [(c.index, c.heading, c.text) for c in chunks] == [
        (0, "Storage", "Storage\n\nHome has a quota.\n\nScratch is purged."),
        (1, "Jobs", "Jobs\n\nUse sbatch to submit."),
    ]
    assert all(c.document_key == "k" for c in chunks)
    assert all(c.num_tokens == chunker.count_tokens(c.text) for c in chunks)


def test_text_before_first_heading_uses_document_title(chunker) -> None:
    chunks = chunker.chunk(doc(P("Preamble text."), T("Part one"), P("Body."), title="Manual"))
    assert [(c.heading, c.text) for c in chunks] == [
        ("Manual", "Manual\n\nPreamble text."), ("Part one", "Part one\n\nBody.")]
    untitled = chunker.chunk(doc(P("Just text.")))
    assert [(c.heading, c.text) for c in untitled] == [(None, "Just text.")]


def test_heading_not_repeated_when_already_first_line(chunker) -> None:
    chunks = chunker.chunk(doc(T("Setup"), P("Setup\nRun the installer first.")))
    assert chunks[0].text == "Setup\nRun the installer first."
    chunks = chunker.chunk(doc(T("Setup"), P("Setups differ between nodes.")))
    assert chunks[0].text == "Setup\n\nSetups differ between nodes."


def test_stacked_headings_are_kept_trailing_ones_make_no_chunk(chunker) -> None:
    d = doc(T("Guide"), T("Install"), P("Run make."), T("Appendix"), T("Next: Usage"))
    chunks = chunker.chunk(d)
    # A chunk of only "Appendix / Next: Usage" would match questions about those titles and
    # answer none of them.
    assert [(c.heading, c.text) for c in chunks] == [("Install", "Guide\nInstall\n\nRun make.")]


def test_a_document_of_headings_only_keeps_them(chunker) -> None:
    chunks = chunker.chunk(doc(T("Release 15.1"), T("Changes"), title="Release 15.1"))
    assert [(c.heading, c.text) for c in chunks] == [("Changes", "Release 15.1\nChanges")]


@pytest.fixture(scope="module")
def in_context(tokenizer) -> Chunker:
    return Chunker(tokenizer, ChunkingConfig(max_tokens=48, overlap_tokens=8, title_context=True))


def test_title_context_heads_sections_with_the_page_title(in_context) -> None:
    # A reference page's sections ("Parameters", "Examples") say nothing of the page they are on.
    d = doc(T("CREATE INDEX"), P("Builds an index."), T("Parameters"), P("CONCURRENTLY builds without locks."),
            T("Examples"), T("Unique"), P("CREATE UNIQUE INDEX t_i ON t (i);"), title="CREATE INDEX")
    assert [(c.heading, c.text) for c in in_context.chunk(d)] == [
        ("CREATE INDEX", "CREATE INDEX\n\nBuilds an index."),  # the heading already says the title
        ("Parameters", "CREATE INDEX › Parameters\n\nCONCURRENTLY builds without locks."),
        ("Unique", "CREATE INDEX › Examples\nUnique\n\nCREATE UNIQUE INDEX t_i ON t (i);"),
    ]
    # Text before any heading is headed by the title alone; an untitled document gets no context.
    assert [c.text for c in in_context.chunk(doc(P("Intro."), T("Setup"), P("Run it."), title="Guide"))] == [
        "Guide\n\nIntro.", "Guide › Setup\n\nRun it."]
    assert [c.text for c in in_context.chunk(doc(T("Setup"), P("Run it.")))] == ["Setup\n\nRun it."]


def test_title_context_gives_way_first_when_the_heading_is_long(in_context) -> None:
    heading = "Configuring the scheduler for preemptible GPU partitions"  # ~10 tokens
    title = " ".join(["Very long page title"] * 6)  # with it, over half the 48-token cap
    chunks = in_context.chunk(doc(T(heading), P("Set PreemptMode."), title=title))
    assert [(c.heading, c.text) for c in chunks] == [(heading, f"{heading}\n\nSet PreemptMode.")]
    assert all(c.num_tokens <= 48 for c in chunks)


def test_chunking_is_recorded_so_older_collections_still_match() -> None:
    plain, titled = ChunkingConfig(100, 10), ChunkingConfig(100, 10, title_context=True)
    assert plain.as_dict() == {"max_tokens": 100, "overlap_tokens": 10}  # as collections recorded it before
    assert titled.as_dict() == {"max_tokens": 100, "overlap_tokens": 10, "title_context": True}
    assert [ChunkingConfig.from_dict(c.as_dict()) for c in (plain, titled)] == [plain, titled]


def test_every_chunk_of_a_long_section_carries_its_heading(chunker) -> None:
    paras = [P(f"Paragraph {i} says something about job arrays and fair share.")
             for i in range(12)]
    chunks = chunker.chunk(doc(T("Scheduling"), *paras))
    assert len(chunks) > 2
    for c in chunks:
        assert c.heading == "Scheduling" and c.text.startswith("Scheduling\n\n")
        assert c.num_tokens <= 48


def test_page_metadata(chunker) -> None:
    chunks = chunker.chunk(doc(P("One.", page=1), P("Two.", page=2), T("Next"), P("Three.", 3)))
    assert chunks[0].metadata == {"page": 1, "page_end": 2}
    assert chunks[1].metadata == {"page": 3}


# ------------------------------------------------------------------------------ splitting


def test_oversized_element_windows_overlap_and_prefer_sentence_ends(chunker) -> None:
    sentences = [f"Sentence number {i} is about node gpu{i:02d}." for i in range(40)]
    chunks = chunker.chunk(doc(T("Log"), P(" ".join(sentences))))
    assert len(chunks) > 3
    bodies = [body(c) for c in chunks]
    for c in chunks:
        assert c.num_tokens <= 48 and c.heading == "Log"
    for b in bodies[:-1]:
        assert b.endswith("."), b  # cut at a sentence end, not mid-word
    for prev, nxt in zip(bodies, bodies[1:], strict=False):
        shared = _longest_suffix_prefix(prev, nxt)
        assert shared, (prev, nxt)
        assert 0 < chunker.count_tokens(shared) <= 8


def test_a_long_table_is_cut_and_overlapped_between_rows(chunker) -> None:
    # A row holds sentence ends ("Prof.", "Dr."): a cut there would split it, and the next
    # window would open in the middle of a row.
    header = "| Date | Speaker | Title |\n| --- | --- | --- |"
    rows = [f"| {d} Jan 2025 | Prof. A. Weiss (ETH) | Talk {d}. Tomography of pores |" for d in range(1, 21)]
    chunks = chunker.chunk(doc(T("Seminars"), Element("Table", "\n".join([header, *rows]))))
    assert len(chunks) > 3
    for c in chunks:
        assert c.num_tokens <= 48
        for line in body(c).splitlines():
            assert line.startswith("| ") and line.endswith(" |"), (line, c.text)
    shown = {line for c in chunks for line in body(c).splitlines()}
    assert set(rows) <= shown  # every row whole in some chunk


def test_no_overlap_when_configured_off(tokenizer) -> None:
    c = Chunker(tokenizer, ChunkingConfig(max_tokens=32, overlap_tokens=0))
    words = " ".join(f"w{i}" for i in range(300))
    chunks = c.chunk(doc(P(words)))
    assert " ".join(body(ch) for ch in chunks) == words


def test_text_without_spaces_is_cut_hard_but_fully(tokenizer) -> None:
    c = Chunker(tokenizer, ChunkingConfig(max_tokens=20, overlap_tokens=4))
    blob = "".join(random.Random(1).choice("abcdefghij0123456789+/") for _ in range(3000))
    chunks = c.chunk(doc(P(blob)))
    assert all(ch.num_tokens <= 20 for ch in chunks)
    _assert_covered(blob, [ch.text for ch in chunks])


def _longest_suffix_prefix(a: str, b: str) -> str:
    for n in range(min(len(a), len(b)), 0, -1):
        if a.endswith(b[:n]):
            return b[:n]
    return ""


def _assert_covered(text: str, pieces: list[str]) -> None:
    """Each piece is a substring of text, found in order, and together they cover it."""
    covered_to = 0
    for piece in pieces:
        # The next piece starts at or before where the last one ended (overlap).
        pos = text.find(piece, max(0, covered_to - len(piece)))
        assert pos != -1, piece
        assert pos <= covered_to or text[covered_to:pos].isspace(), (covered_to, pos)
        covered_to = max(covered_to, pos + len(piece))
    assert covered_to == len(text.rstrip())


# ------------------------------------------------------------------------------ property


def _random_doc(rng: random.Random, n: int) -> Document:
    vocab = ["cluster", "node", "gpu", "quota", "scratch", "job", "sbatch", "genomics",
             "München", "naïve", "x86_64", "--gres=gpu:4", "42", "résumé", "研究", "data."]
    elements = []
    counter = 0
    for _ in range(rng.randint(1, 12)):
        if rng.random() < 0.25:
            elements.append(T(" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 6)))))
            continue
        words = []
        for _ in range(rng.choice([3, 10, 40, 150, 400])):
            counter += 1
            # A unique marker every few words lets the test find each one again.
            words.append(f"m{n}x{counter}" if counter % 3 == 0 else rng.choice(vocab))
            if rng.random() < 0.1:
                words[-1] += rng.choice([".", "!", "?", "\n", ","])
        kind = rng.choice(["NarrativeText", "ListItem", "Table", "UncategorizedText"])
        elements.append(Element(kind, " ".join(words), rng.choice([None, 1, 2])))
    return doc(*elements, title=rng.choice([None, "Doc title"]), key=f"doc{n}")


@pytest.mark.parametrize("title_context", [False, True])
@pytest.mark.parametrize(("max_tokens", "overlap"), [(16, 0), (16, 7), (48, 8), (200, 32)])
def test_property_cap_coverage_indices_determinism(tokenizer, max_tokens: int,
                                                   overlap: int, title_context: bool) -> None:
    c = Chunker(tokenizer, ChunkingConfig(max_tokens=max_tokens, overlap_tokens=overlap, title_context=title_context))
    rng = random.Random(max_tokens * 100 + overlap)
    for n in range(15):
        d = _random_doc(rng, n)
        chunks = c.chunk(d)
        assert [ch.index for ch in chunks] == list(range(len(chunks)))
        assert all(ch.document_key == d.key for ch in chunks)
        for ch in chunks:
            assert ch.num_tokens == c.count_tokens(ch.text) <= max_tokens
            assert ch.text.strip()
        joined = "\n".join(ch.text for ch in chunks)
        found = set(re.findall(r"\bm\d+x\d+\b", joined))
        last_body = max((i for i, el in enumerate(d.elements) if el.kind != "Title"), default=len(d.elements))
        for el in d.elements[:last_body + 1]:  # headings after the last body text make no chunk
            if c.count_tokens(el.text) < max_tokens // 2:
                assert el.text.strip() in joined  # small elements stay whole
            missing = set(re.findall(r"\bm\d+x\d+\b", el.text)) - found
            assert not missing, missing  # every word of a split element, unbroken
        assert c.chunk(d) == chunks  # deterministic
