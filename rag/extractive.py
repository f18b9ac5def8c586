"""Extractive answers: quote the sources' best-supported sentences, each with its `[n]` citation.

A small generator (the packaged 135M SmolLM2) paraphrases wrongly, loops and invents markers.
Quoting is honest by construction: every sentence of the answer is a sentence of a source the
asker was shown (the prepared, post-checked sources, never anything else), every `[n]` is that
source's number, and a question that no sentence answers well enough gets no answer at all.
Sentences are scored against the question by the cross-encoder, the model that reranked the
sources, through the same batched scoring (concurrent requests share forward passes).

A table (Markdown rows, as ingest/table_text.py writes parsed tables) is quoted a row at a
time, never whole: each row is one unit, its cells labelled with the header's and led by the
section heading ("Schedule — Date: 9 Apr 2025; Speaker: Prof. Anna Weiss; ..."), so a row says
what its cells are both to the cross-encoder and to the reader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rag.types import Hit

# (question, passages) -> one cross-encoder logit per passage (rag.batching.BatchedReranker's batcher).
ScoreFn = Callable[[str, list[str]], list[float]]

# A sentence ends at . ! or ? followed by space, or at a line break (Markdown lists, tables, headings).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# List bullets, heading marks and table pipes at the start of a line: layout, not text.
_LEADING_MARKUP = re.compile(r"^(?:[#>*\-+|]+|\d+[.)])\s+")
_MIN_WORDS = 3  # shorter fragments ("Contents", "Notes:") answer nothing
_HEADING_WORDS = 5  # an unpunctuated line this short is a heading ("Using the GPU nodes"), not an answer
# The chunker's title context ("Basalt Cluster User Guide › Using the GPU nodes", ingest/chunk.py)
# leads a chunk's text: a heading however long it is. The title is given to the scorer anyway.
_BREADCRUMB = " \u203a "
_MAX_SENTENCE_WORDS = 60  # longer is flattened layout, not a sentence: quoted by windows of
_WINDOW_WORDS = 24  # words, overlapping by half
_FLAT_TABLE_PIPES = 6  # cell separators that make a shorter run a flattened table too (a row or more)
# A Markdown table row ("| a | b |") and the line under a header ("| --- | :---: |").
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
_TABLE_SEPARATOR = re.compile(r"^\s*\|(?:\s*:?-{3,}:?\s*\|)+\s*$")
_EMPTY_CELLS = {"", "-", "\u2013", "\u2014"}  # "-" and dashes: "nothing here" in most tables


@dataclass(frozen=True)
class ExtractConfig:
    """How an extractive answer is chosen.

    Attributes:
        floor: the cross-encoder logit the best sentence must reach; below it the answer is
            "I don't know". ms-marco cross-encoders put unrelated text far below 0 and an
            answering sentence above it; -2.5 (relevance ~0.08) was chosen on the sample
            questions: their answering sentences score above -2, and the best sentences of
            questions that must be refused below -3.3.
        source_floor: the logit a whole source must reach to be quoted when none of its
            sentences reaches `floor` alone: an answer spread over sentences (a procedure, a
            definition and its value) is judged as a whole, so the source's best sentences
            are quoted. On the sample questions, sources of two such answers score 0.2 and
            1.2 while no sentence does above -4, and the best source of a question that must
            be refused scores at most -3.9.
        max_sentences: sentences quoted at most.
        margin: a further sentence is quoted only if it scores within `margin` of the best
            (a second, clearly weaker sentence adds noise, not support).
    """

    floor: float = -2.5
    source_floor: float = -2.5
    max_sentences: int = 2
    margin: float = 3.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_sentences <= 10:
            raise ValueError(f"max_sentences must be in 1..10, got {self.max_sentences}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


@dataclass(frozen=True)
class Sentence:
    """A sentence of source number `number` (1-based, the citation it gets)."""

    text: str
    number: int
    score: float = float("-inf")


def split_sentences(text: str) -> list[str]:
    """The sentences of a chunk's text, layout marks stripped, fragments of under three words dropped."""
    out = []
    for piece in _SENTENCE_END.split(text.strip()):
        sentence = _LEADING_MARKUP.sub("", piece.strip()).strip()
        words = len(sentence.split())
        heading = (words <= _HEADING_WORDS or _BREADCRUMB in sentence) and sentence[-1:] not in ".!?:;)"
        if words > _MAX_SENTENCE_WORDS or (words > _WINDOW_WORDS and sentence.count(" | ") >= _FLAT_TABLE_PIPES):
            out += _windows(sentence.split())
        elif words >= _MIN_WORDS and not heading:
            out.append(sentence)
    return out


def _windows(words: list[str]) -> list[str]:
    """An overlong "sentence" as overlapping word windows, each marked "…" where it was cut.

    Past _MAX_SENTENCE_WORDS a run of text is not a sentence but flattened layout: a table of
    a text file or PDF whose line breaks the parser joined ("gpu04 | R12/U15 | ... gpu05 | ..."),
    as is a shorter run with a row's worth of " | " separators in it.
    Quoting it whole buries the answer; a window around the answer's cells says it.
    """
    size, step = _WINDOW_WORDS, _WINDOW_WORDS // 2
    starts = range(0, max(len(words) - step, 1), step)
    return [("\u2026" if i else "") + " ".join(words[i : i + size]) + ("\u2026" if i + size < len(words) else "")
            for i in starts]


def split_units(text: str, heading: str | None = None) -> list[str]:
    """What may be quoted from a chunk, in order: its prose sentences and each table row.

    Args:
        text: the chunk's text; Markdown tables in it are read a row at a time.
        heading: the chunk's section heading, which leads each row's quote.
    """
    out: list[str] = []
    prose: list[str] = []
    table: list[str] = []
    for line in [*text.strip().splitlines(), ""]:  # the empty line ends a table that ends the text
        if _TABLE_ROW.match(line):
            if prose:
                out += split_sentences("\n".join(prose))
                prose = []
            table.append(line)
            continue
        if table:
            out += table_rows(table, heading)
            table = []
        prose.append(line)
    return out + split_sentences("\n".join(prose))


def table_rows(lines: Sequence[str], heading: str | None = None) -> list[str]:
    """A Markdown table's data rows as quotable units: "Heading — Column: value; Column: value".

    Cells are labelled by the header when the table has one (a separator line under its first
    row); a chunk that starts mid-table has none, and its cells are joined by " | ". Rows with
    fewer than two filled cells say nothing on their own and are left out.
    """
    has_header = len(lines) > 1 and not _TABLE_SEPARATOR.match(lines[0]) and _TABLE_SEPARATOR.match(lines[1])
    rows = [_cells(line) for line in lines if not _TABLE_SEPARATOR.match(line)]
    header = rows.pop(0) if has_header else None
    out = []
    for cells in rows:
        filled = [(i, c) for i, c in enumerate(cells) if c not in _EMPTY_CELLS]
        if len(filled) < 2:
            continue
        if header is not None:
            body = "; ".join(f"{header[i]}: {c}" if i < len(header) and header[i] else c for i, c in filled)
        else:
            body = " | ".join(c for _, c in filled)
        out.append(f"{heading} \u2014 {body}" if heading else body)
    return out


def _cells(line: str) -> list[str]:
    return [" ".join(c.split()) for c in line.strip().strip("|").split("|")]


def candidate_sentences(sources: Sequence[Hit], parts: Sequence[Sequence[Hit]] | None = None) -> list[Sentence]:
    """Every distinct sentence (or table row) of the sources, with the number of the first source it occurs in.

    Overlapping chunks repeat sentences; each is scored (and quoted) once. `parts`: the chunks
    each source is read from, when a source joins two (retrieval.second_chunks); each chunk's
    table rows are then led by its own section heading, not the source's.
    """
    seen: set[str] = set()
    out = []
    for number, chunks in enumerate(_parts(sources, parts), 1):
        for hit in chunks:
            for sentence in split_units(hit.text, hit.heading):
                key = _same_text_key(sentence)
                if key not in seen:
                    seen.add(key)
                    out.append(Sentence(sentence, number))
    return out


def _parts(sources: Sequence[Hit], parts: Sequence[Sequence[Hit]] | None) -> Sequence[Sequence[Hit]]:
    """The chunks of each source: `parts` when given (one list per source), else each source alone."""
    if parts is None:
        return [[h] for h in sources]
    if len(parts) != len(sources) or any(not p or any(c.document_key != s.document_key for c in p)
                                         for s, p in zip(sources, parts, strict=True)):
        raise ValueError("parts must give each source one or more chunks of its own document")
    return parts


def scoring_text(sentence: Sentence, sources: Sequence[Hit]) -> str:
    """What the cross-encoder reads for a sentence: its source's title, then the sentence.

    A sentence alone often lacks its subject ("It is set to -65 C."); the title gives it back.
    The title belongs to the same source, so nothing the asker may not read is scored.
    """
    hit = sources[sentence.number - 1]
    title = hit.title or hit.heading
    return f"{title}: {sentence.text}" if title else sentence.text


def extract_answer(question: str, sources: Sequence[Hit], score: ScoreFn,
                   config: ExtractConfig = ExtractConfig(),
                   source_scores: Sequence[float] | None = None,
                   parts: Sequence[Sequence[Hit]] | None = None) -> str | None:
    """The answer quoted from `sources`, or None when neither a sentence nor a source reaches its floor.

    Args:
        question: what was asked.
        sources: the sources shown with the answer, in citation order ([1] is sources[0]).
            Only these are read: pass the prepared, permission-checked sources.
        score: cross-encoder logits for (question, passages), batched.
        config: floors, number of sentences, margin.
        source_scores: the cross-encoder's logits of the sources themselves (question, hit
            text), when the reranker has scored them; None scores them here, in the same
            batch as the sentences.
        parts: the chunks each source is read from, in document order (a source joined with
            its page's second chunk is two: retrieval.second_chunks); None: each source alone.

    Returns:
        Sentences best first, each followed by its marker ("... -65 C [2]."), or None.
    """
    parts = _parts(sources, parts)
    candidates = candidate_sentences(sources, parts)
    if not candidates:
        return None
    passages = [scoring_text(s, sources) for s in candidates]
    logits = score(question, passages + ([h.text for h in sources] if source_scores is None else []))
    if source_scores is None:
        source_scores = logits[len(candidates):]
    assert len(source_scores) == len(sources), "one score per source"
    scored = sorted((Sentence(s.text, s.number, v) for s, v in zip(candidates, logits[: len(candidates)], strict=True)),
                    key=lambda s: -s.score)  # stable: ties keep source order
    if scored[0].score >= config.floor:
        threshold = max(config.floor, scored[0].score - config.margin)
    else:
        scored = _sentences_of_best_source(scored, parts, source_scores, config.source_floor)
        if not scored:
            return None
        # The source answered as a whole: its sentences are all below `floor`, and compete only with each other.
        threshold = scored[0].score - config.margin
    chosen = [s for s in scored[: config.max_sentences] if s.score >= threshold]
    return " ".join(cite(s.text, s.number) for s in chosen)


def _sentences_of_best_source(scored: list[Sentence], parts: Sequence[Sequence[Hit]], source_scores: Sequence[float],
                              source_floor: float) -> list[Sentence]:
    """The scored sentences of the best source (its `parts`), best first, if it reaches `source_floor`; else []."""
    best = max(range(len(parts)), key=lambda i: (source_scores[i], -i))  # ties: the earlier source
    if source_scores[best] < source_floor:
        return []
    units = {_same_text_key(u) for hit in parts[best] for u in split_units(hit.text, hit.heading)}
    # A sentence is numbered by the first source it occurs in; one also in the best source is its.
    return [Sentence(s.text, best + 1, s.score) for s in scored if _same_text_key(s.text) in units]


def _same_text_key(sentence: str) -> str:
    """What makes two quotable units the same one: their words, case and spacing aside."""
    return " ".join(sentence.casefold().split())


def cite(sentence: str, number: int) -> str:
    """The sentence with its marker before the final punctuation: "The alarm is at -65 C [2]."."""
    sentence = sentence.rstrip()
    if sentence[-1:] in (".", "!", "?", ":", ";"):
        end = sentence[-1] if sentence[-1] in ".!?" else "."
        return f"{sentence[:-1].rstrip()} [{number}]{end}"
    return f"{sentence} [{number}]."
