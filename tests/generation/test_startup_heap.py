"""freeze_startup_heap: start-up objects leave the collector's generations; later garbage is still collected."""

from __future__ import annotations

import gc
import time
import weakref

from generation.engine.startup_heap import freeze_startup_heap


class Node:
    pass


def test_start_up_objects_are_frozen_and_later_cycles_still_collected():
    kept = Node()
    kept.self = kept  # a cycle alive at start-up
    try:
        frozen = freeze_startup_heap()
        # Frozen objects that another thread frees (one left by an earlier test in this worker)
        # leave the permanent generation, so the count can only have dropped since.
        assert 0 < gc.get_freeze_count() <= frozen
        # A full collection no longer scans it: it is in the permanent generation.
        assert not any(obj is kept for obj in gc.get_objects())
        later = Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        # gc.collect() returns at once, collecting nothing, while another thread is collecting
        # (an engine thread left by an earlier test, say): try again until a collection ran.
        for _ in range(200):
            gc.collect()
            if ref() is None:
                break
            time.sleep(0.01)
        assert ref() is None, "garbage made after the freeze is collected as usual"
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(obj is kept for obj in gc.get_objects())
