"""Contract suite: every `Reranker` (retrieval/base.py) reorders the hits it is given, and nothing more.

Implementations, all over the packaged cross-encoder (ms-marco-MiniLM-L-12-v2, loaded once):

- "cross-encoder": `retrieval.rerank.CrossEncoderReranker` itself;
- "batched": `rag.batching.BatchedReranker`, what the query service reranks with;
- "batched:shared": the same wrapper, but every call is made to share its scoring pass with
  another user's request (deterministically: see `SharedBatchReranker`), so that the contracts
  are checked where batching could mix requests up.

A reranker only ever sees hits that already passed the permission post-check
(`retrieval/retriever.py`). So the contract is about identity: it returns new `Hit`s for a subset
of its input, best first by its own score, with every other field unchanged, and it fetches
nothing (no file, database or network access while it reranks: checked with an audit hook).

A new Reranker implementation: add its name to IMPLEMENTATIONS and build it in `reranker`.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from rag.batching import BatchedReranker
from rag.errors import ConfigError
from rag.types import Hit
from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir

# The models themselves are under test here: every forward pass is computed (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("without_forward_memo")

IMPLEMENTATIONS = ["cross-encoder", "batched", "batched:shared"]
SCORE_TOLERANCE = 1e-4  # padding in a different batch moves a logit by ~1e-6, never by this

SLURM = "How do I submit a job array with Slurm?"
RELEVANT = ("Use sbatch --array=1-10 job.sh to submit a Slurm job array; each task gets its "
            "index in SLURM_ARRAY_TASK_ID.")
IRRELEVANT = [
    "The cafeteria serves lunch from noon to two.",
    "Photosynthesis converts light energy into chemical energy.",
    "The storage quota for home directories is 50 GB.",
    "Book the confocal microscope a week ahead on the facility calendar.",
]


@pytest.fixture(scope="module")
def cross_encoder(model_cache: Path) -> CrossEncoderReranker:
    return CrossEncoderReranker(resolve_reranker_dir(None, model_cache), device="cpu")


class _GatedScorer:
    """The cross-encoder, except that a scoring call waits while the gate is closed."""

    def __init__(self, model: CrossEncoderReranker) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.apply_scores = model.apply_scores

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        self.gate.wait(timeout=60)
        return self.model.score_pairs(pairs)


class SharedBatchReranker:
    """A BatchedReranker whose every call shares one scoring pass with another user's request.

    A blocker request first occupies the batcher's worker (its scoring waits on a gate); the
    caller's request and a decoy request from "mallory" then queue behind it, and the gate opens
    once both are queued, so they are scored as one batch. Each call checks that they were, and
    that the decoy got exactly its own ranking (nothing crossed between the two requests).
    """

    DECOY_QUERY = "When does the freezer alarm go off?"

    def __init__(self, model: CrossEncoderReranker) -> None:
        self.scorer = _GatedScorer(model)
        self.inner = BatchedReranker(self.scorer)
        texts = ["The -80 freezer alarm sounds above -70 C.", "Autoclave tapes turn black when done."]
        self.decoy_hits = [_hit(9000 + i, t, acl=frozenset({"user:mallory"})) for i, t in enumerate(texts)]
        self.decoy_expected = [h.chunk_id for h in model.rerank(self.DECOY_QUERY, self.decoy_hits)]
        self.shared_batches = 0

    def rerank(self, query: str, hits: Sequence[Hit], top_n: int | None = None) -> list[Hit]:
        stats = self.inner.batcher.stats
        outcome: dict[str, object] = {}

        def call_caller() -> None:
            try:
                outcome["hits"] = self.inner.rerank(query, hits, top_n)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                outcome["error"] = e

        def call_decoy() -> None:
            outcome["decoy"] = self.inner.rerank(self.DECOY_QUERY, self.decoy_hits)

        self.scorer.gate.clear()
        batches, calls = stats.num_batches, stats.num_calls
        blocker = threading.Thread(target=self.inner.rerank, args=("blocker", [_hit(8000, "blocker")]))
        blocker.start()
        _wait_for(lambda: stats.num_batches > batches)  # the worker is now held at the gate
        decoy, caller = threading.Thread(target=call_decoy), threading.Thread(target=call_caller)
        decoy.start()
        caller.start()
        # Empty input, top_n=0 and bad arguments return without queueing anything.
        _wait_for(lambda: stats.num_calls == calls + 3 or (not caller.is_alive() and stats.num_calls == calls + 2))
        queued_together = stats.num_calls == calls + 3
        self.scorer.gate.set()
        for t in (blocker, decoy, caller):
            t.join(timeout=60)
        assert [h.chunk_id for h in outcome["decoy"]] == self.decoy_expected  # type: ignore[union-attr]
        if queued_together:
            assert stats.num_batches == batches + 2  # the blocker's pass, then one shared pass
            self.shared_batches += 1
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["hits"]  # type: ignore[return-value]

    def close(self) -> None:
        self.inner.close()


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the batcher did not get the queued requests"
        time.sleep(0.001)


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def reranker(request, cross_encoder: CrossEncoderReranker) -> Iterator:
    if request.param == "cross-encoder":
        yield cross_encoder
        return
    wrapper = BatchedReranker(cross_encoder) if request.param == "batched" else SharedBatchReranker(cross_encoder)
    yield wrapper
    wrapper.close()
    if isinstance(wrapper, SharedBatchReranker):
        assert wrapper.shared_batches > 0  # the variant did share passes, not only claim to


# --- no fetching: an audit hook sees every file, socket, database or process the code opens ----

_IO_EVENTS = ("open", "os.", "shutil.", "glob.", "socket.", "sqlite3.", "http.", "urllib.",
              "ftplib.", "smtplib.", "subprocess.", "import", "ctypes.dlopen")
_recording: list[list[str]] = []  # non-empty while a test records; the hook cannot be removed


def _audit(event: str, _args: tuple) -> None:
    if _recording and event.startswith(_IO_EVENTS):
        _recording[0].append(event)


sys.addaudithook(_audit)


def _rerank_recording_io(reranker, query: str, hits: Sequence[Hit], top_n: int | None = None
                         ) -> tuple[list[Hit], list[str]]:
    events: list[str] = []
    _recording.append(events)
    try:
        return reranker.rerank(query, hits, top_n), events
    finally:
        _recording.clear()


# --- helpers -----------------------------------------------------------------------------------


def _hit(chunk_id: int, text: str, score: float = 0.5, acl: frozenset[str] = frozenset({"public"}),
         heading: str | None = None, title: str | None = None) -> Hit:
    return Hit(chunk_id=chunk_id, document_key=f"/lab/doc{chunk_id}.md", source=f"/lab/doc{chunk_id}.md",
               chunk_index=chunk_id % 7, text=text, score=score, heading=heading, title=title, acl=acl)


def _varied_hits(texts: Sequence[str]) -> list[Hit]:
    """Hits whose every field differs, so that a field copied from the wrong hit shows."""
    acls = [frozenset({"public"}), frozenset({"group:imaging"}), frozenset({"user:alice", "group:hpc"})]
    return [_hit(100 + 3 * i, t, score=1.0 - i / 10, acl=acls[i % len(acls)],
                 heading=f"Section {i}" if i % 2 else None, title=f"Doc {i}")
            for i, t in enumerate(texts)]


_scores_seen: dict[tuple[str, tuple[str, ...]], list[float]] = {}


def _model_scores(model: CrossEncoderReranker, query: str, texts: Sequence[str]) -> list[float]:
    """The model's own scores of the passages (each implementation gets the same inputs: once)."""
    key = (query, tuple(texts))
    if key not in _scores_seen:
        _scores_seen[key] = model.score(query, texts)
    return _scores_seen[key]


def _check_reranked(query: str, hits: Sequence[Hit], out: list[Hit], top_n: int | None,
                    model: CrossEncoderReranker) -> None:
    """The whole contract for one call: a best-first subset of the input, identities intact."""
    assert isinstance(out, list)
    assert len(out) == (len(hits) if top_n is None else min(top_n, len(hits)))
    by_id = {h.chunk_id: h for h in hits}
    assert len({h.chunk_id for h in out}) == len(out)  # no hit twice
    for h in out:
        assert type(h) is Hit
        original = by_id[h.chunk_id]  # KeyError: a hit that was not given (invented or fetched)
        assert h is not original  # a new Hit: callers may keep the pre-rerank ones
        assert replace(h, score=original.score) == original  # only the score changes
        assert math.isfinite(h.score)
    scores = [h.score for h in out]
    assert scores == sorted(scores, reverse=True)
    # Best first by *its* score: the scores are the model's scores of these passages, and the
    # hits left out by top_n score no higher than the last one kept.
    want = dict(zip([h.chunk_id for h in hits], _model_scores(model, query, [h.text for h in hits]), strict=True))
    for h in out:
        assert h.score == pytest.approx(want[h.chunk_id], abs=SCORE_TOLERANCE)
    left_out = [want[i] for i in by_id if i not in {h.chunk_id for h in out}]
    if out and left_out:
        assert max(left_out) <= out[-1].score + SCORE_TOLERANCE


# --- the contracts -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("top_n", [None, 0, 1, 3, 5, 6, 50])
def test_returns_a_best_first_subset_of_new_hits_with_identities_intact(reranker, cross_encoder, top_n):
    hits = _varied_hits([IRRELEVANT[0], IRRELEVANT[1], RELEVANT, IRRELEVANT[2], IRRELEVANT[3]])
    before = list(hits)
    out = reranker.rerank(SLURM, hits, top_n)
    _check_reranked(SLURM, hits, out, top_n, cross_encoder)
    assert hits == before  # the input list is left as it was
    if out:
        assert out[0].chunk_id == hits[2].chunk_id


def test_top_n_is_a_prefix_of_the_full_ranking(reranker):
    hits = _varied_hits([*IRRELEVANT, RELEVANT])
    full = [h.chunk_id for h in reranker.rerank(SLURM, hits)]
    for top_n in range(len(hits) + 2):
        assert [h.chunk_id for h in reranker.rerank(SLURM, hits, top_n)] == full[:top_n]


@pytest.mark.parametrize("top_n", [None, 0, 1, 10])
def test_empty_input_gives_empty_output(reranker, top_n):
    assert reranker.rerank(SLURM, [], top_n) == []
    assert reranker.rerank(SLURM, (), top_n) == []


def test_a_negative_top_n_is_a_clear_error_not_a_silent_cut(reranker):
    # rescored[:-1] would quietly drop the last hit; refusing is the only safe reading.
    hits = _varied_hits([RELEVANT, IRRELEVANT[0]])
    with pytest.raises(ConfigError, match="top_n"):
        reranker.rerank(SLURM, hits, -1)


def test_any_sequence_of_hits_is_accepted(reranker, cross_encoder):
    hits = tuple(_varied_hits([IRRELEVANT[0], RELEVANT]))
    out = reranker.rerank(SLURM, hits, None)
    _check_reranked(SLURM, hits, out, None, cross_encoder)


def test_same_input_same_output(reranker):
    hits = _varied_hits([IRRELEVANT[3], RELEVANT, IRRELEVANT[1], IRRELEVANT[0]])
    first = reranker.rerank(SLURM, hits, 3)
    for _ in range(3):
        assert reranker.rerank(SLURM, hits, 3) == first  # same hits, same scores, same order


def test_the_order_is_by_relevance_not_by_input_position_or_score(reranker):
    # The relevant passage comes in last with the worst retrieval score, in every position.
    for position in range(len(IRRELEVANT) + 1):
        texts = list(IRRELEVANT)
        texts.insert(position, RELEVANT)
        hits = [_hit(i, t, score=-float(i)) for i, t in enumerate(texts)]
        out = reranker.rerank(SLURM, hits)
        assert out[0].chunk_id == position
        assert out[0].score - out[1].score > 5.0  # logits: a wide margin, not a coin toss
    other = [("What is the capital of France?", "Paris is the capital and most populous city of France.",
              ["Berlin is the capital of Germany.", "The cafeteria serves lunch from noon to two."]),
             ("how many GPUs does each node have",
              "Each compute node has four NVIDIA A100 GPUs with 80 GB of memory.",
              ["The storage quota for home directories is 50 GB.", "Photosynthesis needs light."])]
    for query, relevant, irrelevant in other:
        hits = [_hit(i, t) for i, t in enumerate([*irrelevant, relevant])]
        assert reranker.rerank(query, hits, 1)[0].text == relevant


def test_reversed_input_gives_the_same_ranking(reranker):
    hits = _varied_hits([*IRRELEVANT, RELEVANT])
    forward = reranker.rerank(SLURM, hits)
    backward = reranker.rerank(SLURM, hits[::-1])
    assert [h.chunk_id for h in backward] == [h.chunk_id for h in forward]
    assert [h.score for h in backward] == pytest.approx([h.score for h in forward], abs=SCORE_TOLERANCE)


def test_duplicate_texts_are_all_kept_tied_in_input_order(reranker, cross_encoder):
    same = "Slurm is a workload manager for Linux clusters."
    hits = [_hit(7, same), _hit(3, IRRELEVANT[0]), _hit(9, same), _hit(1, RELEVANT), _hit(4, same)]
    out = reranker.rerank(SLURM, hits)
    _check_reranked(SLURM, hits, out, None, cross_encoder)
    assert [h.chunk_id for h in out][:4] == [1, 7, 9, 4]
    assert out[1].score == out[2].score == out[3].score  # one text, one score
    assert [h.chunk_id for h in reranker.rerank(SLURM, hits, 2)] == [1, 7]


def test_duplicates_in_different_scoring_batches_still_tie_in_input_order(reranker, cross_encoder):
    # Passages are scored longest first, batch_size at a time: with batch_size - 1 longer
    # passages in front, the two copies fall into different batches, padded to different
    # lengths. They must still get one score and keep their input order.
    same = "Slurm is a workload manager for Linux clusters."
    filler = [f"Filler sentence number {i} about the weather and the lunch menu. " * 3
              for i in range(cross_encoder.batch_size - 1)]
    hits = [_hit(i, t) for i, t in enumerate([*filler, same, same])]
    first, second = len(filler), len(filler) + 1
    out = reranker.rerank(SLURM, hits)
    _check_reranked(SLURM, hits, out, None, cross_encoder)
    ids = [h.chunk_id for h in out]
    assert ids.index(first) + 1 == ids.index(second)
    assert out[ids.index(first)].score == out[ids.index(second)].score


@pytest.mark.slow
def test_text_longer_than_the_model_takes_is_truncated_not_an_error(reranker, cross_encoder):
    words = cross_encoder.max_length * 2  # well past the model's positions, in tokens
    long_relevant = RELEVANT + " " + " ".join(["array"] * words)
    long_irrelevant = " ".join(["lunch"] * words)
    hits = _varied_hits([long_irrelevant, IRRELEVANT[0], long_relevant])
    out = reranker.rerank(SLURM, hits)
    _check_reranked(SLURM, hits, out, None, cross_encoder)
    assert out[0].text == long_relevant  # truncation keeps the start, where the answer is
    long_query = SLURM + " " + " ".join(["please"] * words)
    _check_reranked(long_query, hits, reranker.rerank(long_query, hits, 2), 2, cross_encoder)


UNICODE_TEXTS = [
    "日本語のテキスト：ジョブ配列は sbatch --array で投入します。",
    "emoji 🎉🧪🖥️ and a flag 🇩🇪 in the middle",
    "Zürich, naïve, cafe\u0301 (combining accent), ﬁ ligature",
    "مرحبا بالعالم — right to left",
    "zero\u200bwidth\u200djoiner\ufeffand BOM",
    "control \x00 NUL \x07 bell \t tab \r\n newline",
    "",  # an empty chunk (a heading-only section) must not break the batch
    "   \n\t  ",
]


@pytest.mark.slow
def test_unicode_text_and_queries(reranker, cross_encoder):
    hits = _varied_hits([*UNICODE_TEXTS, RELEVANT])
    for query in [SLURM, "ジョブ配列の投入方法は？", "🎉 Zürich café", "", "\x00"]:
        out = reranker.rerank(query, hits)
        _check_reranked(query, hits, out, None, cross_encoder)
        if query == SLURM:
            assert out[0].text == RELEVANT


def test_only_the_given_hits_come_back_and_nothing_is_fetched(reranker):
    # What the post-check let through: the reranker may reorder and cut it, never add to it,
    # and it has nowhere to add from (no file, database or network access while it reranks).
    allowed = _varied_hits([IRRELEVANT[0], IRRELEVANT[1]])
    out, io = _rerank_recording_io(reranker, SLURM, allowed)
    assert {h.chunk_id for h in out} <= {h.chunk_id for h in allowed}
    assert all(h.text != RELEVANT for h in out)  # the best passage exists, but was not given
    assert io == []


def test_the_io_recorder_sees_files_databases_and_sockets(tmp_path):
    # The check above is only as good as the hook: a reranker that fetched must be caught.
    import socket
    import sqlite3

    class FetchingReranker:
        def rerank(self, query, hits, top_n=None):
            sqlite3.connect(tmp_path / "catalog.sqlite").close()
            (tmp_path / "chunk.txt").open("w").close()
            with socket.socket() as s, pytest.raises(OSError):
                s.connect(("127.0.0.1", 9))  # the discard port: nothing listens, it is refused
            return list(hits)

    _, io = _rerank_recording_io(FetchingReranker(), SLURM, [])
    assert {"sqlite3.connect", "open", "socket.connect"} <= set(io)
    seen = list(io)
    (tmp_path / "after.txt").write_text("")
    assert io == seen  # recording stops when the call returns
