"""The GIL switch interval is lowered while an overlapped embed thread runs, and restored after."""

from __future__ import annotations

import sys
import threading

import pytest

from rag import switch_interval
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL, acquire_shorter, release_shorter, shorter_switch_interval


@pytest.fixture(autouse=True)
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)
    assert switch_interval._holders == 0, "a test left the interval lowered"


def test_nested_holders_keep_it_lowered_until_the_last_leaves() -> None:
    with shorter_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(OVERLAP_SWITCH_INTERVAL)
        acquire_shorter()
        release_shorter()
        assert sys.getswitchinterval() == pytest.approx(OVERLAP_SWITCH_INTERVAL)  # the outer one still holds
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_it_never_raises_an_interval_someone_set_lower() -> None:
    sys.setswitchinterval(1e-5)
    with shorter_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(1e-5)
    assert sys.getswitchinterval() == pytest.approx(1e-5)


def test_an_extra_release_changes_nothing() -> None:
    release_shorter()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_holders_on_several_threads_restore_once_all_are_done() -> None:
    inside, leave = threading.Barrier(5), threading.Event()

    def hold() -> None:
        with shorter_switch_interval():
            inside.wait(timeout=10)
            leave.wait(timeout=10)

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    inside.wait(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(OVERLAP_SWITCH_INTERVAL)
    leave.set()
    for t in threads:
        t.join(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(0.005)
