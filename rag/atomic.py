"""Publishing a finished folder in one step, so readers never see half of one.

Stdlib only: every package (generation included) may use it, like rag.errors.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def publish_dir(tmp: Path, target: Path, is_complete: Callable[[Path], bool]) -> None:
    """Move the finished folder `tmp` to `target`, replacing an outdated one.

    rename() cannot replace a non-empty directory, so an outdated `target` is moved aside
    first. Losing a race to another process that published a complete `target` is fine.
    """
    if target.exists():
        if is_complete(target):
            return
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_complete(target):
            raise
