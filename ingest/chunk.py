"""Title-aware chunking of parsed documents under a token cap of the embedder's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from rag.types import Chunk, Document, Element

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_SENTENCE_END = (".", "!", "?", ":", ";")
_Piece = tuple[str, str | None, list[int], int]  # (chunk text, heading, pages, tokens)

# Normalizers and pre-tokenizers under which a text's tokens are those of its whitespace-separated
# pieces: the normalizers change characters one by one (never across a space), the pre-tokenizers
# cut at every whitespace. The tokens of "a\n\nb" are then those of "a" and of "b".
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents"}
_WHITESPACE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"}
_MEMO_LIMIT = 200_000  # counted texts kept between precounts (a window's texts, then what chunking asks)


@dataclass(frozen=True)
class ChunkingConfig:
    """How big chunks are: `max_tokens` per chunk (heading included), `overlap_tokens` between
    the windows of a paragraph too big for one chunk; with `title_context`, a section's chunks
    are headed "document title › section heading" instead of the section heading alone, so a
    chunk under "Parameters" or "Examples" still says which command's page it is from."""

    max_tokens: int = 200
    overlap_tokens: int = 32
    title_context: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The form a collection records its chunking in (`BuildSpec.chunking`). `title_context`
        appears only when on, so collections built before it existed still match it when off."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "overlap_tokens": self.overlap_tokens}
        if self.title_context:
            out["title_context"] = True
        return out

    @classmethod
    def from_dict(cls, recorded: dict[str, Any]) -> ChunkingConfig:
        """The config a collection's recorded chunking (`as_dict`) was built with."""
        return cls(recorded["max_tokens"], recorded["overlap_tokens"], bool(recorded.get("title_context", False)))

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 16:
            raise ValueError(f"max_tokens must be an integer >= 16, got {self.max_tokens!r}")
        if isinstance(self.overlap_tokens, bool) or not isinstance(self.overlap_tokens, int) \
                or not 0 <= self.overlap_tokens < self.max_tokens / 2:
            raise ValueError(
                f"overlap_tokens must be an integer with 0 <= overlap_tokens < max_tokens/2 "
                f"(0..{(self.max_tokens - 1) // 2} for max_tokens={self.max_tokens}), "
                f"got {self.overlap_tokens!r}"
            )


@dataclass
class _Section:
    """A run of body elements under the same heading(s)."""

    heading: str | None
    titles: list[str]  # stacked headings (no body between them), outermost first
    has_real_titles: bool  # False while `titles` is only the document-title fallback
    body: list[Element] = field(default_factory=list)
    context: int = 0  # characters of "title › " that _in_context put before titles[0]


class Chunker:
    """Splits a Document into Chunks of at most `max_tokens` tokens.

    A Title element starts a new section; every chunk of a section starts with its heading
    ("heading\\n\\nbody", counted in the cap) and records it in `Chunk.heading`. Text before
    the first Title is headed by the document's title. Consecutive elements of a section
    are packed into one chunk while they fit; an element too big for a chunk is cut into
    token windows (at sentence or word ends where possible) that overlap by `overlap_tokens`.
    Headings after the last body text make no chunk of their own (unless the document has no
    body text at all): a chunk that is only a heading answers nothing.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast | Tokenizer,
        config: ChunkingConfig = ChunkingConfig(),  # noqa: B008 -- frozen, so sharing is safe
        batched: bool = True,
    ) -> None:
        """Args:
            tokenizer: the embedder's Hugging Face fast tokenizer (or a `tokenizers.Tokenizer`).
            config: the size limits.
            batched: count tokens from the counts of the parts (elements, headings) that `precount`
                tokenizes many at a time, where the tokenizer cuts at whitespace (WordPiece models
                such as MiniLM and BGE); the chunks are the same. False tokenizes every candidate
                chunk on its own, one call each (the path before batching, kept for comparison).
        """
        if isinstance(tokenizer, Tokenizer):
            backend = tokenizer
        else:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise TypeError("Chunker needs a Hugging Face fast tokenizer (use_fast=True)")
        # A private copy without truncation or padding: tokenizer.json files often carry the
        # model's max length (128 for MiniLM), which would make long texts look short.
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.no_truncation()
        self._tok.no_padding()
        self.config = config
        self.is_batched = batched and _splits_at_whitespace(self._tok)
        self._counts: dict[str, int] = {}  # text -> tokens, for texts counted by `precount` (batched only)
        self._batch_tok: Tokenizer | None = None  # count_batch's own copy (it may run on another thread)

    def count_tokens(self, text: str) -> int:
        """Number of tokens in `text`, without special tokens ([CLS], [SEP])."""
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def precount(self, texts: Iterable[str]) -> int:
        """Tokenize `texts` (element texts, titles of the documents about to be chunked) in one
        batch call, so that chunking them asks the tokenizer only about windows of oversized
        elements. Counts from an earlier call are forgotten. Returns how many texts were new.

        A no-op unless `is_batched`. The batch call runs on the tokenizer's threads where
        TOKENIZERS_PARALLELISM allows them.
        """
        counts = self.count_batch(texts)
        self.use_counts(counts)
        return len(counts)

    def count_batch(self, texts: Iterable[str]) -> dict[str, int]:
        """{text: tokens} of `texts` (stripped, each once), in one batch call; {} unless `is_batched`.

        Safe beside this chunker's own use on another thread (a tokenizer copy of its own): the
        ingest counts the next window here while it chunks the current one (`use_counts`). The
        batch call releases the GIL.
        """
        if not self.is_batched:
            return {}
        todo = list({t.strip(): None for t in texts if t and t.strip()})
        if not todo:
            return {}
        if self._batch_tok is None:
            self._batch_tok = Tokenizer.from_str(self._tok.to_str())
        encodings = self._batch_tok.encode_batch_fast(todo, add_special_tokens=False)
        return {t: len(e) for t, e in zip(todo, encodings, strict=True)}

    def use_counts(self, counts: dict[str, int]) -> None:
        """Chunk from these counts (a `count_batch` result) from now on; earlier ones are forgotten."""
        self._counts = counts

    def _count(self, text: str) -> int:
        """`count_tokens`, from the precounted texts where it can be."""
        n = self._counts.get(text)
        if n is None:
            n = self.count_tokens(text)
            if self.is_batched:
                if len(self._counts) >= _MEMO_LIMIT:
                    self._counts = {}
                self._counts[text] = n
        return n

    def _count_composed(self, prefix: str, parts: list[str]) -> int:
        """Tokens of `_compose(prefix, parts)`: the sum of its parts' counts where the tokenizer
        cuts at whitespace (the parts are joined by blank lines), else the tokenizer's count."""
        if not self.is_batched:
            return self.count_tokens(self._compose(prefix, parts))
        n = sum(self._count(p) for p in parts)
        if not self._absorbs(prefix, parts):
            n += self._count(prefix)
        return n

    def chunk(self, doc: Document) -> list[Chunk]:
        """The chunks of `doc`, indexed 0..n-1, each within the token cap.

        Every element's text ends up in some chunk (split elements across consecutive ones),
        except headings that follow the document's last body text.
        """
        elements: Iterable[Element] = doc.elements
        if not doc.elements and doc.text.strip():
            elements = [Element(kind="NarrativeText", text=doc.text)]
        return list(self.iter_chunks(doc, elements))

    def iter_chunks(self, doc: Document, elements: Iterable[Element]) -> Iterator[Chunk]:
        """The chunks of `doc` whose elements are `elements`, produced as the elements are read.

        The same chunks as `chunk` (it is this, over `doc.elements`), but a section is packed as
        its elements arrive, so a huge document streams through with only the chunk being filled
        in memory. `doc.elements` and `doc.text` are not read.
        """
        for i, (text, heading, pages, n) in enumerate(self._pieces(doc.title, elements)):
            assert n <= self.config.max_tokens, (n, text[:80])
            meta: dict[str, Any] = {}
            if pages:
                meta["page"] = pages[0]
                if pages[-1] != pages[0]:
                    meta["page_end"] = pages[-1]
            yield Chunk(document_key=doc.key, index=i, text=text, num_tokens=n,
                        heading=heading, metadata=meta)

    # ------------------------------------------------------------------------- sections

    def _pieces(self, doc_title: str | None, elements: Iterable[Element]) -> Iterator[_Piece]:
        """Sections as the elements come: a Title after body text closes the section before it."""
        title = doc_title.strip() if doc_title and doc_title.strip() else None
        current = _Section(heading=title, titles=[title] if title else [], has_real_titles=False)
        packer: _SectionPacker | None = None  # opened at the section's first body element
        has_body = False
        for el in elements:
            text = el.text.strip()
            if not text:
                continue
            if el.kind != "Title":
                has_body = True
                if packer is None:
                    packer = _SectionPacker(self, self._in_context(current, title))
                yield from packer.add(Element(kind=el.kind, text=text, page=el.page))
            elif packer is not None:
                yield from packer.close()
                current = _Section(heading=text, titles=[text], has_real_titles=True)
                packer = None
            elif not current.has_real_titles:
                # The document-title fallback gives way to the first real heading.
                current.heading, current.titles, current.has_real_titles = text, [text], True
            else:
                current.titles.append(text)  # stacked headings: keep all, nearest is the heading
                current.heading = text
        if packer is not None:
            yield from packer.close()
        elif not has_body:
            # A document of headings only: its headings are all it says, so they are its chunk.
            yield from _SectionPacker(self, self._in_context(current, title)).close()
        # else: trailing headings with no text under them (a page's footer bar, say) would be a
        # chunk that only repeats a title; it matches questions about that title and answers none.

    def _in_context(self, section: _Section, doc_title: str | None) -> _Section:
        """`section`, its outermost heading preceded by "doc_title › " when `title_context` is on.

        Only real headings get the context (the title fallback is the title itself), and not a
        heading that already says the title (a page whose first heading is its title).
        """
        if not (self.config.title_context and doc_title and section.has_real_titles and section.titles):
            return section
        first = section.titles[0]
        if doc_title.casefold() in first.casefold():
            return section
        return _Section(heading=section.heading, titles=[f"{doc_title} › {first}", *section.titles[1:]],
                        has_real_titles=True, context=len(doc_title) + len(" › "))

    @staticmethod
    def _absorbs(prefix: str, parts: list[str]) -> bool:
        """Whether `_compose` leaves the prefix out: there is none, or the heading already opens
        the body (its first line(s))."""
        if not prefix:
            return True
        body = "\n\n".join(parts)
        return body == prefix or body.startswith(prefix + "\n")

    @staticmethod
    def _compose(prefix: str, parts: list[str]) -> str:
        body = "\n\n".join(parts)
        if Chunker._absorbs(prefix, parts):
            return body
        return f"{prefix}\n\n{body}"

    def _fits(self, text: str) -> bool:
        return self.count_tokens(text) <= self.config.max_tokens

    def _fits_composed(self, prefix: str, parts: list[str]) -> bool:
        return self._count_composed(prefix, parts) <= self.config.max_tokens

    # --------------------------------------------------------------------------- splitting

    def _split(self, text: str, prefix: str) -> list[str]:
        """Cut `text` into overlapping windows that each fit the cap after `prefix`.

        Windows are cut at token boundaries (offset mapping), preferring sentence ends, then
        word ends. Each window's character span runs up to the start of the first token it
        gives to the next one, so characters that make no token are never dropped.
        """
        cap = self.config.max_tokens
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = enc.offsets
        n = len(offsets)
        overhead = self.count_tokens(self._compose(prefix, ["x"])) - self.count_tokens("x")
        budget = max(1, cap - overhead)
        windows: list[str] = []
        start = 0
        while True:
            begin = 0 if start == 0 else offsets[start][0]
            if n - start <= budget:
                tail = text[begin:].strip()
                if self._fits(self._compose(prefix, [tail])):
                    windows.append(tail)
                    return windows
            assert start < n - 1, "a single token always fits: the prefix is at most half the cap"
            end = self._best_cut(text, offsets, start, min(start + budget, n - 1))
            piece = text[begin:offsets[end][0]].strip()
            # Re-tokenizing a substring can differ at a cut inside a word: shrink until it fits.
            while end > start + 1 and not self._fits(self._compose(prefix, [piece])):
                end -= 1
                piece = text[begin:offsets[end][0]].strip()
            windows.append(piece)
            start = self._next_start(text, offsets, start, end)

    def _best_cut(self, text: str, offsets: list[tuple[int, int]], start: int, end: int) -> int:
        """Token index in (start, end] to cut before.

        The latest line break in the window's second half (a table's rows are lines: a cut at
        "Prof." would split a row), else the latest sentence end there, else the latest word
        end anywhere in it (a short window beats a broken word), else `end` (one long "word").
        """
        floor = start + max(1, (end - start) // 2)
        word_cut = sentence_cut = None
        for i in range(end, start, -1):
            gap = text[offsets[i - 1][1]:offsets[i][0]]
            if not any(c.isspace() for c in gap):
                continue  # inside a word: its pieces, or punctuation glued to it, touch
            if i >= floor and "\n" in gap:
                return i
            if i >= floor and sentence_cut is None and text[offsets[i - 1][1] - 1] in _SENTENCE_END:
                sentence_cut = i
            if word_cut is None:
                word_cut = i
            if i < floor:
                break  # no line break or sentence end can come below the floor
        if sentence_cut is not None:
            return sentence_cut
        return word_cut if word_cut is not None else end

    def _next_start(self, text: str, offsets: list[tuple[int, int]], start: int, end: int) -> int:
        """Where the next window starts: `overlap_tokens` back from the cut, at a word start."""
        overlap = min(self.config.overlap_tokens, (end - start) // 2)
        nxt = end - overlap
        # Moving forward keeps the overlap within overlap_tokens: to a line start if the overlap
        # holds one (a table's next window then opens with a whole row); after a cut at a line
        # break, to the cut itself rather than into the middle of the line before it; else to
        # a word start.
        for i in range(max(nxt, start + 1), end):
            if "\n" in text[offsets[i - 1][1]:offsets[i][0]]:
                return i
        if end < len(offsets) and "\n" in text[offsets[end - 1][1]:offsets[end][0]]:
            return end
        for i in range(nxt, end):
            if i == 0 or any(c.isspace() for c in text[offsets[i - 1][1]:offsets[i][0]]):
                return max(i, start + 1)
        return max(end, start + 1)


class _SectionPacker:
    """Packs one section's body elements, given one at a time, into pieces under the cap.

    The heading prefix may use at most half the cap; headings that don't fit become body text
    (fed first), so they are chunked like any other text instead of being lost.
    """

    def __init__(self, chunker: Chunker, section: _Section) -> None:
        self.chunker = chunker
        self.heading = section.heading
        titles = list(section.titles)
        limit = chunker.config.max_tokens // 2
        if section.context and chunker._count("\n".join(titles)) > limit:
            titles[0] = titles[0][section.context:]  # the title context goes first: it is only context
        moved: list[str] = []
        while titles and chunker._count("\n".join(titles)) > limit:
            moved.append(titles.pop(0))
        self.prefix = "\n".join(titles)
        self.has_real_titles = section.has_real_titles
        # else: the fallback is Document.title, kept with the document; a too-long one is dropped.
        self._moved = [Element(kind="Title", text=t) for t in moved] if section.has_real_titles else []
        self._has_body = False
        self._parts: list[str] = []
        self._pages: list[int] = []

    def add(self, el: Element) -> list[_Piece]:
        out = self._take_moved()
        self._add(el, out)
        return out

    def close(self) -> list[_Piece]:
        out = self._take_moved()
        if not self._has_body:
            if self.has_real_titles and self.prefix:
                out.append((self.prefix, self.heading, [], self.chunker._count(self.prefix)))
            return out
        self._flush(out)
        return out

    def _take_moved(self) -> list[_Piece]:
        out: list[_Piece] = []
        moved, self._moved = self._moved, []
        for el in moved:
            self._add(el, out)
        return out

    def _add(self, el: Element, out: list[_Piece]) -> None:
        self._has_body = True
        c = self.chunker
        if c._fits_composed(self.prefix, [*self._parts, el.text]):
            self._parts.append(el.text)
        else:
            self._flush(out)
            if c._fits_composed(self.prefix, [el.text]):
                self._parts.append(el.text)
            else:
                windows = c._split(el.text, self.prefix)
                for w in windows[:-1]:
                    out.append((c._compose(self.prefix, [w]), self.heading,
                                [el.page] if el.page is not None else [], c._count_composed(self.prefix, [w])))
                self._parts.append(windows[-1])  # the tail may still share a chunk with what follows
        if el.page is not None:
            self._pages.append(el.page)

    def _flush(self, out: list[_Piece]) -> None:
        if self._parts:
            c = self.chunker
            out.append((c._compose(self.prefix, self._parts), self.heading, sorted(set(self._pages)),
                        c._count_composed(self.prefix, self._parts)))
            self._parts.clear()
            self._pages.clear()


def _splits_at_whitespace(tok: Tokenizer) -> bool:
    """Whether `tok` counts a text joined by whitespace as the sum of its parts' counts.

    Read from its normalizer and pre-tokenizer (see `_LOCAL_NORMALIZERS`), with added tokens that
    hold no whitespace (one could match across a joint), then checked on a sample. Byte-level BPE
    and SentencePiece tokenizers (which mark a word's leading space) are not: they count exactly.
    """
    spec = json.loads(tok.to_str())

    def made_of(node: dict[str, Any] | None, allowed: set[str], key: str) -> bool:
        if node is None:
            return key == "normalizers"  # no normalizer is fine; no pre-tokenizer is one big word
        if node.get("type") == "Sequence":
            return all(made_of(n, allowed, key) for n in node.get(key, []))
        return node.get("type") in allowed

    if not (made_of(spec.get("normalizer"), _LOCAL_NORMALIZERS, "normalizers")
            and made_of(spec.get("pre_tokenizer"), _WHITESPACE_PRE_TOKENIZERS, "pretokenizers")):
        return False
    if any(any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens", [])):
        return False
    a, b = "Dr. Ada's run: 42 GPUs (naïve)", "Résumé—中文 text\tend."
    count = len(tok.encode(f"{a}\n\n{b}", add_special_tokens=False))
    return count == len(tok.encode(a, add_special_tokens=False)) + len(tok.encode(b, add_special_tokens=False))
