"""One writer per collection: a second `rag ingest` of the same collection waits for the first.

Two ingests of one collection at the same time would share its staging database and, with the
embedded store, each write the whole Faiss index at its end: the last writer would win and the
other's vectors would be lost (their records would stay, unreachable by dense search). So an
ingest holds an exclusive lock beside its staging file for its whole run. The lock is an
`flock` on a private file, released by the kernel when the process ends, even killed, so a
crashed ingest never leaves a stale lock behind.

Shards of a pgvector collection (`rag ingest --shard i/n`) each have their own staging file and
so their own lock: they still write concurrently, as the database allows.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


@contextmanager
def exclusive_ingest(lock_path: Path, what: str) -> Iterator[None]:
    """Hold the ingest lock at lock_path for the block; wait (saying so) while another process holds it.

    Args:
        lock_path: the lock file (created owner-only if missing; its directory must exist).
        what: names the locked thing in the waiting message, e.g. "collection 'docs'".
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another ingest is writing %s; waiting for it to finish", what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
