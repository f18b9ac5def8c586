"""CopyLanding: copies back from the host tier still in flight, and which step must wait for which.

Issue 16 item 5: a hit in the host tier is copied back on a copy stream of its own, so that it
runs beside the steps the request queues behind instead of in front of them. The copies of one
restore form a group with one event recorded after them on that stream. A step waits only for
the groups holding a block it reads or writes; a group whose event has completed is dropped
before anyone needs to wait. Groups complete in issue order (one stream), so landed ones are
dropped from the front.

No torch here: the events are anything with `query()` (CUDA events in HostKVBuffer, fakes in
the unit tests), and waiting is the caller's (`compute_stream.wait_event`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from typing import Protocol


class CopyEvent(Protocol):
    def query(self) -> bool: ...


class CopyLanding:
    """Groups of GPU blocks being copied back, each closed by the event recorded after its copies."""

    def __init__(self) -> None:
        self._groups: deque[tuple[CopyEvent, frozenset[int]]] = deque()
        self._open: list[int] = []
        # Blocks copied back whose copy had landed when first checked, and blocks a step (or a
        # gather for a copy out) had to wait for: how much of the copying the overlap hid.
        self.num_hidden_blocks = 0
        self.num_waited_blocks = 0

    @property
    def is_open(self) -> bool:
        """Copies were issued since the last group was closed."""
        return bool(self._open)

    @property
    def num_in_flight_groups(self) -> int:
        return len(self._groups) + bool(self._open)

    def add(self, block_id: int) -> None:
        """A copy into block_id was just issued on the copy stream (into the open group)."""
        self._open.append(block_id)

    def close(self, record: Callable[[], CopyEvent]) -> None:
        """End the open group with an event recorded (by `record`) after its copies."""
        if self._open:
            self._groups.append((record(), frozenset(self._open)))
            self._open = []

    def prune(self) -> None:
        """Drop the groups whose copies have landed (from the front: they land in issue order)."""
        while self._groups and self._groups[0][0].query():
            self.num_hidden_blocks += len(self._groups.popleft()[1])

    def take_needed(self, touched: Callable[[], Collection[int]] | None) -> list[CopyEvent]:
        """The events a step touching `touched()` must wait for; those groups are then forgotten.

        Call `close` first: the open group has no event yet. `touched` is called only when some
        copy is still in flight (building a batch's block set costs more than the usual empty
        check); None means every block (wait for everything).
        """
        self.prune()
        if not self._groups:
            return []
        blocks = None if touched is None else touched()
        needed: list[CopyEvent] = []
        kept: deque[tuple[CopyEvent, frozenset[int]]] = deque()
        for event, group in self._groups:
            if blocks is None or not group.isdisjoint(blocks):
                needed.append(event)
                self.num_waited_blocks += len(group)
            else:
                kept.append((event, group))
        self._groups = kept
        return needed
