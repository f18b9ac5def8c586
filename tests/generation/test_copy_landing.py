"""CopyLanding: which in-flight copies back a step waits for (host tier, issue 16 item 5)."""

from __future__ import annotations

from generation.engine.copy_landing import CopyLanding


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False

    def query(self) -> bool:
        return self.done


def landing_with(groups: list[list[int]]) -> tuple[CopyLanding, list[FakeEvent]]:
    landing, events = CopyLanding(), []
    for i, blocks in enumerate(groups):
        for b in blocks:
            landing.add(b)
        event = FakeEvent(f"g{i}")
        landing.close(lambda e=event: e)
        events.append(event)
    return landing, events


def test_a_step_waits_only_for_the_groups_holding_a_block_it_touches():
    landing, (g0, g1, g2) = landing_with([[1, 2], [3], [4, 5, 6]])
    assert landing.take_needed(lambda: {2, 6, 99}) == [g0, g2]
    assert (landing.num_waited_blocks, landing.num_hidden_blocks) == (5, 0)
    # Waited groups are forgotten; the other one is still in flight.
    assert landing.num_in_flight_groups == 1
    assert landing.take_needed(lambda: {2, 6}) == []
    assert landing.take_needed(lambda: {3}) == [g1]
    assert landing.num_in_flight_groups == 0


def test_landed_groups_are_dropped_in_issue_order_and_count_as_hidden():
    landing, (g0, g1, g2) = landing_with([[1], [2, 3], [4]])
    g0.done = g2.done = True  # g2 "done" out of order cannot happen on one stream: pruning stops at g1
    asked = []
    assert landing.take_needed(lambda: asked.append(1) or {4}) == [g2]
    assert landing.num_hidden_blocks == 1 and landing.num_waited_blocks == 1
    g1.done = True
    landing.prune()
    assert landing.num_in_flight_groups == 0 and landing.num_hidden_blocks == 3


def test_nothing_in_flight_never_builds_the_step_block_set():
    landing, (g0,) = landing_with([[7]])
    g0.done = True

    def touched() -> set[int]:
        raise AssertionError("the block set is built only while a copy is in flight")

    assert landing.take_needed(touched) == []
    assert landing.num_hidden_blocks == 1


def test_none_waits_for_everything_and_the_open_group_needs_a_close():
    landing, (g0, g1) = landing_with([[1], [2]])
    landing.add(3)
    assert landing.is_open and landing.num_in_flight_groups == 3
    late = FakeEvent("late")
    landing.close(lambda: late)
    landing.close(lambda: FakeEvent("never"))  # nothing open: no empty group
    assert landing.take_needed(None) == [g0, g1, late]
    assert landing.num_waited_blocks == 3 and landing.num_in_flight_groups == 0
