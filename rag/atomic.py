"""Publishing a finished folder in one step, so readers never see half of one.

Stdlib only (with rag.private_files): every package (generation included) may use it, like rag.errors.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from rag.private_files import make_tree_private


def publish_dir(tmp: Path, target: Path, is_complete: Callable[[Path], bool], *, private: bool = True) -> None:
    """Move the finished folder `tmp` to `target`, replacing an outdated one.

    rename() cannot replace a non-empty directory, so an outdated `target` is moved aside
    first. Losing a race to another process that published a complete `target` is fine.

    Args:
        private: make `tmp` and everything in it owner-only first (what lands in a data
            directory: converted models); False publishes the modes as they are.
    """
    if private:
        # Writers such as save_pretrained create files with the umask's mode; mkdtemp's 0700 on
        # the folder alone would not survive the folder being copied or moved elsewhere.
        make_tree_private(tmp)
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
