"""freeze_startup_heap: keep the objects of start-up (modules, models, indexes) out of later full GCs.

Python's collector scans every tracked object of the oldest generation in a full collection,
and a process that imports torch and transformers holds ~170k of them before it has served
anything: one full collection took 284 ms on the H200 host, in the middle of a request's step
(bench/rag_kv_reuse.py --trace-slow, seq load: that request's time to first token was 382 ms
against ~60 ms for its peers). None of those objects will become garbage while serving, so a
server moves them to the permanent generation once it is ready (`gc.freeze`); full collections
then scan only what serving itself created. Objects made later are collected as usual.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from future collections; how many were frozen.

    Call when start-up is over (models loaded, before traffic). Process-wide; calling it again
    later freezes what was made since. `gc.unfreeze()` undoes it (before dropping a large frozen
    structure, e.g. an engine that is replaced, so that it can be collected).
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of full GCs (%.0f ms)", frozen, (time.perf_counter() - start) * 1e3)
    return frozen
