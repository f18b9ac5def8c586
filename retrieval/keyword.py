"""Keyword terms of a user query, and a safe SQLite FTS5 MATCH expression built from them.

The store-specific keyword searches (SQLite FTS5 in `retrieval.stores.embedded.keyword_index`, Postgres full text
in the pgvector store) share `query_terms`, so both legs see the same words of a question.
User text never reaches a query parser as syntax: every term becomes a quoted phrase.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable

MAX_TERMS = 32  # a pasted paragraph must not turn into a thousand-phrase OR query

# Characters that may join the word pieces of one identifier (gpu-a100-03, MERGE_VCFS,
# 7.10.30, secret/hpc/breakglass, alice@niqb.org); a run that starts or ends with one is trimmed.
_JOINERS = frozenset("-_./:@+'’")

# Very common English words: they match nearly every chunk and only add noise to BM25.
# Question words are here too, since a question's subject never hides in "what" or "how".
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are aren't as at be because been
before being below between both but by can can't cannot could couldn't did didn't do does
doesn't doing don't down during each either else ever every few for from further get gets
got had hadn't has hasn't have haven't having he her here hers herself him himself his how
i if in into is isn't it it's its itself just let's like may me might more most much must
mustn't my myself need no nor not now of off on once only or other ought our ours ourselves
out over own per please same shall shan't she should shouldn't so some such than that that's
the their theirs them themselves then there there's these they this those through to too
under until up upon us use used using very via was wasn't we were weren't what what's when
where which while who whom whose why will with within without won't would wouldn't you your
yours yourself yourselves
""".split())


def _is_word_char(ch: str) -> bool:
    # Letters, digits and combining marks (Devanagari vowel signs, decomposed accents) of any
    # script; a plain `\w` regex would cut words at combining marks and keep lone underscores.
    return ch.isalnum() or unicodedata.category(ch).startswith("M")


def _raw_tokens(text: str) -> Iterable[str]:
    """Maximal runs of word characters and joiners, with leading/trailing joiners trimmed."""
    start = None
    for i, ch in enumerate(text + " "):
        if _is_word_char(ch) or (ch in _JOINERS and start is not None):
            if start is None:
                start = i
            continue
        if start is not None:
            token = text[start:i]
            while token and token[-1] in _JOINERS:
                token = token[:-1]
            if token:
                yield token
            start = None


def query_terms(text: str, max_terms: int = MAX_TERMS) -> list[str]:
    """Words of a user query to search as keywords, in the order they appear.

    Identifiers stay whole (`QOSMaxGRESPerJob`, `BRCA1`, `gpu-a100-03`, `E-VCF-017`); tokens
    without a letter or digit are dropped, as are very common English words and the
    possessive "'s". Terms are deduplicated case-insensitively (keyword indexes fold case)
    and capped at `max_terms`, keeping the first ones.

    Args:
        text: the user's question or search string, any script.
        max_terms: the most terms returned.

    Returns:
        The terms, original spelling, possibly empty.
    """
    text = unicodedata.normalize("NFC", text)
    terms: list[str] = []
    seen: set[str] = set()
    for token in _raw_tokens(text):
        if token[-2:] in ("'s", "’s") and len(token) > 2:
            token = token[:-2]
        folded = token.casefold().replace("’", "'")
        if folded in STOP_WORDS or folded in seen:
            continue
        # A single Latin letter ("s" of a stray apostrophe, "x" of "3 x 4") matches nearly
        # everything; one CJK character is a word, and one digit may be a rack or a GPU number.
        if len(token) == 1 and token.isascii() and token.isalpha():
            continue
        seen.add(folded)
        terms.append(token)
        if len(terms) >= max_terms:
            break
    return terms


def fts5_match(terms: Iterable[str]) -> str:
    """An FTS5 MATCH expression that matches a row containing any of `terms` (OR).

    Each term is a double-quoted FTS5 string with inner quotes doubled, so the FTS5 query
    parser reads it as one phrase: operators (`OR`, `NOT`, `NEAR(`), column filters (`text:`),
    prefix stars and parentheses inside a term are plain text. A multi-word term (`E-VCF-017`
    is `e vcf 017` to the tokenizer) matches only its words in order, adjacent.

    Raises:
        ValueError: `terms` is empty (an empty MATCH is a syntax error, not "match nothing").
    """
    phrases = ['"' + term.replace('"', '""') + '"' for term in terms]
    if not phrases:
        raise ValueError("no keyword terms: check query_terms(text) is non-empty before searching")
    return " OR ".join(phrases)


def bm25_over_readable(matches: dict[str, set[int]], chunks: dict[int, tuple[float, str, str | None]],
                       num_readable: int, avg_length: float, k: int, k1: float = 1.2, b: float = 0.75,
                       heading_weight: float = 2.0) -> list[tuple[int, float]]:
    """BM25 whose statistics come only from chunks the caller may read.

    FTS5's own bm25() takes IDF and average length from the whole table, every ACL included,
    so a score (or even the order of two readable chunks) would say how common a term is in
    text the caller may not read. Here document frequency, collection size and average length
    are counted over the readable chunks alone, so rankings depend on nothing else. Term
    frequency is counted in the chunk's text (an occurrence in its heading counts
    `heading_weight` times); FTS5 decided that the chunk matches (stemming included), so it
    counts at least once.

    Args:
        matches: term -> ids of readable chunks that contain it.
        chunks: chunk id -> (length in tokens, text, heading) of every chunk in `matches`.
        num_readable: number of readable chunks in the collection.
        avg_length: their mean length.
    Returns:
        (chunk id, score) best first, ties by smaller id, at most k.
    """
    n = max(num_readable, 1)
    avg = avg_length if avg_length > 0 else 1.0
    parts: dict[int, list[float]] = {}
    for term, ids in matches.items():
        if not ids:
            continue
        idf = math.log(1.0 + (n - len(ids) + 0.5) / (len(ids) + 0.5))
        pattern = re.compile(r"(?<!\w)" + re.escape(term), re.IGNORECASE)
        for cid in ids:
            length, text, heading = chunks[cid]
            tf = len(pattern.findall(text)) + heading_weight * len(pattern.findall(heading or ""))
            tf = max(tf, 1.0)
            norm = 1.0 - b + b * length / avg
            parts.setdefault(cid, []).append(idf * tf * (k1 + 1.0) / (tf + k1 * norm))
    # fsum: the same terms summed in another order give the same float, so ties stay ties
    scores = {cid: math.fsum(p) for cid, p in parts.items()}
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
