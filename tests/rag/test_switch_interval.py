"""The GIL switch interval is lowered while an overlapped embed thread runs, and restored after."""

from __future__ import annotations

import sys
import threading

import pytest

from rag import switch_interval
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS, acquire_shorter, release_shorter

SHORT = OVERLAP_SWITCH_INTERVAL_MS / 1000.0


@pytest.fixture(autouse=True)
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)
    assert switch_interval._holders == 0, "a test left the interval lowered"


def test_nested_holders_keep_it_lowered_until_the_last_leaves() -> None:
    acquire_shorter()
    assert sys.getswitchinterval() == pytest.approx(SHORT)
    acquire_shorter()
    release_shorter()
    assert sys.getswitchinterval() == pytest.approx(SHORT)  # the first one still holds
    release_shorter()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_it_never_raises_an_interval_someone_set_lower() -> None:
    sys.setswitchinterval(1e-5)
    acquire_shorter()
    assert sys.getswitchinterval() == pytest.approx(1e-5)
    release_shorter()
    assert sys.getswitchinterval() == pytest.approx(1e-5)


def test_an_extra_release_changes_nothing() -> None:
    release_shorter()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_holders_on_several_threads_restore_once_all_are_done() -> None:
    inside, leave = threading.Barrier(5), threading.Event()

    def hold() -> None:
        acquire_shorter()
        try:
            inside.wait(timeout=10)
            leave.wait(timeout=10)
        finally:
            release_shorter()

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    inside.wait(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(SHORT)
    leave.set()
    for t in threads:
        t.join(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(0.005)
