"""answer_events over a scripted generator: loop stop, marker cleanup, queue wait, deadline, aborts.

A scripted generator is fine here: this is the unit test of one module. The real engine and a real
remote server are exercised end to end in test_openai_api.py and test_remote_generator.py.
"""

from __future__ import annotations

import asyncio

import pytest

from rag.admission import AdmissionControl
from rag.answering import Admitted, AnswerDone, PreparedAnswer, answer_events
from rag.errors import DeadlineExceeded, OverloadedError
from rag.generator import GenerationDone, GenerationRequest, TextDelta
from rag.types import Answer, Citation


class Scripted:
    """Yields the given pieces (with an optional pause before each), then GenerationDone."""

    model_name = "scripted"

    def __init__(self, pieces, pause: float = 0.0) -> None:
        self.pieces, self.pause = pieces, pause
        self.pulled: list[str] = []
        self.closed = 0

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def is_ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass

    async def stream(self, request):
        try:
            for p in self.pieces:
                if self.pause:
                    await asyncio.sleep(self.pause)
                self.pulled.append(p)
                yield TextDelta(p)
            yield GenerationDone("stop", prompt_tokens=7, completion_tokens=len(self.pieces))
        finally:
            self.closed += 1


def prepared(num_sources: int = 2) -> PreparedAnswer:
    cites = [Citation(n, f"doc{n}", f"/d/{n}", 0, 1.0, "t") for n in range(1, num_sources + 1)]
    answer = Answer(question="q", text=None, citations=cites, hits=[])
    return PreparedAnswer(answer, GenerationRequest(messages=[{"role": "user", "content": "q"}]))


async def collect(events):
    return [e async for e in events]


def test_generation_stops_once_the_answer_loops():
    gen = Scripted(["Use ", "gpu01.", " Ask.", " Use gpu01.", " more", " and more", "."])
    events = asyncio.run(collect(answer_events(prepared(), gen, AdmissionControl(1, 0))))
    done = events[-1]
    assert isinstance(done, AnswerDone) and done.answer.text == "Use gpu01. Ask."
    assert len(gen.pulled) == 4 and gen.closed == 1  # not drained past the loop, and closed


def test_markers_to_missing_sources_are_removed_while_streaming():
    gen = Scripted(["GPU nodes are gpu01 [", "1] and gpu02 [", "4].", " See [2, 7]."])
    events = asyncio.run(collect(answer_events(prepared(2), gen, AdmissionControl(1, 0))))
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == "GPU nodes are gpu01 [1] and gpu02. See [2]."
    assert events[-1].answer.text == streamed
    assert isinstance(events[0], Admitted)
    assert events[-1].usage.prompt_tokens == 7


def test_queue_wait_is_reported_apart_from_generation():
    admission = AdmissionControl(1, 4)

    async def main():
        slow, fast = Scripted([f"a{i}. " for i in range(3)], pause=0.1), Scripted(["b."])
        first = asyncio.create_task(collect(answer_events(prepared(), slow, admission)))
        await asyncio.sleep(0.02)
        second = await collect(answer_events(prepared(), fast, admission))
        return await first, second

    first, second = asyncio.run(main())
    t1, t2 = first[-1].answer.timings, second[-1].answer.timings
    assert t1["queue"] < 0.05 and t2["queue"] >= 0.2  # waited for the slow one's whole generation
    assert t2["generate"] < t2["queue"]  # its own generation is not blamed for the wait


def test_full_queue_is_refused_with_retry_after():
    admission = AdmissionControl(1, 1)

    async def main():
        gens = [Scripted([f"x{i}." for i in range(5)], pause=0.05) for _ in range(3)]
        tasks = [asyncio.create_task(collect(answer_events(prepared(), g, admission))) for g in gens[:2]]
        await asyncio.sleep(0.02)
        with pytest.raises(OverloadedError) as err:
            await collect(answer_events(prepared(), gens[2], admission))
        results = await asyncio.gather(*tasks)
        return err.value, results

    err, results = asyncio.run(main())
    assert err.retry_after >= 1 and all(isinstance(r[-1], AnswerDone) for r in results)
    snap = admission.snapshot()
    assert (snap.in_flight, snap.queued, snap.num_rejected) == (0, 0, 1)


def test_deadline_aborts_the_generation_and_frees_the_slot():
    admission = AdmissionControl(1, 0)
    gen = Scripted([f"slow{i}. " for i in range(50)], pause=0.05)

    async def main():
        import time

        with pytest.raises(DeadlineExceeded):
            await collect(answer_events(prepared(), gen, admission, deadline=time.monotonic() + 0.2))

    asyncio.run(main())
    assert gen.closed == 1 and len(gen.pulled) < 50
    assert admission.snapshot().in_flight == 0


def test_a_consumer_that_leaves_frees_its_slot_and_closes_the_stream():
    admission = AdmissionControl(1, 0)
    gen = Scripted(["word "] * 50, pause=0.01)

    async def main():
        events = answer_events(prepared(), gen, admission)
        async for event in events:
            if isinstance(event, TextDelta):
                break
        await events.aclose()

    asyncio.run(main())
    assert gen.closed == 1 and admission.snapshot().in_flight == 0


def test_no_generation_needed_yields_the_fixed_text():
    p = prepared()
    p.answer.text, p.request = "I don't know.", None
    events = asyncio.run(collect(answer_events(p, None, AdmissionControl(1, 0))))
    assert [type(e) for e in events] == [TextDelta, AnswerDone] and events[0].text == "I don't know."


def test_check_refuses_early_only_when_slots_and_queue_are_full():
    admission = AdmissionControl(1, 1)

    async def main():
        gens = [Scripted([f"x{i}." for i in range(5)], pause=0.05) for _ in range(2)]
        admission.check()  # empty: passes
        tasks = [asyncio.create_task(collect(answer_events(prepared(), g, admission))) for g in gens]
        await asyncio.sleep(0.02)
        with pytest.raises(OverloadedError):
            admission.check()
        await asyncio.gather(*tasks)
        admission.check()  # drained: passes again

    asyncio.run(main())


def test_a_repeated_sentence_is_never_streamed():
    pieces = ["The nodes are gpu07", " and gpu08.\n\n", "Book them first.\n", "The nodes", " are gpu07", " and gpu08.",
              " more text."]
    gen = Scripted(pieces)
    events = asyncio.run(collect(answer_events(prepared(), gen, AdmissionControl(1, 0))))
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed.count("gpu07") == 1 and "Book them first." in streamed and "more text" not in streamed
    assert gen.closed == 1 and len(gen.pulled) == 6  # stopped at the repeat


def test_a_sentence_that_starts_like_an_earlier_one_but_differs_is_shown():
    from rag.prompts import RepeatGuard

    guard = RepeatGuard()
    out = guard.feed("Use gpu07. ") + guard.feed("Use gpu") + guard.feed("08 instead.") + guard.flush()
    assert out == "Use gpu07. Use gpu08 instead." and not guard.repeated
    held = RepeatGuard()
    assert held.feed("Use gpu07. ") == "Use gpu07. " and held.feed("Use gpu") == ""  # held: may be a repeat


@pytest.mark.parametrize("pieces, answer", [
    (["\n ", " The nodes are gpu07", " and gpu08.\n\n", "Book them  first.\n", "The nodes", " are gpu07",
      " and gpu08.", " more text."],  # a paragraph break and a double space kept; the loop cut
     "The nodes are gpu07 and gpu08.\n\nBook them  first."),
    (["  Use [", "1]", " gpu01.  ", "\n", " Then ask [", "3]. ", " \n"],  # edge whitespace, a dropped marker
     "Use [1] gpu01.  \n Then ask."),
    ([" \n", "  "], ""),  # nothing but whitespace
])
def test_the_final_answer_is_exactly_the_streamed_deltas(pieces, answer):
    events = asyncio.run(collect(answer_events(prepared(2), Scripted(pieces), AdmissionControl(1, 0))))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(deltas) == events[-1].answer.text == answer
    assert all(deltas)  # no empty deltas
