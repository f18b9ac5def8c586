"""Silence third-party progress bars and chatter during our own model loads, then put them back.

transformers draws "Loading weights" bars and logs advice on every `from_pretrained`, and its
GGUF converter draws a tqdm bar of its own; in a notebook or script those land between the
user's cells. Our own progress (rag/progress.py) is what people should see. The settings are
process-wide, so `quiet_libraries()` changes them only while one of our loads runs and restores
exactly what it found, so a notebook user's own transformers settings survive our calls.

Stdlib-only at the top level (transformers is imported lazily), so every package may import it,
like rag/errors.py.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# transformers' GGUF loader binds `tqdm.auto.tqdm` at import time, outside transformers' own
# progress-bar switch (and TQDM_DISABLE is read once, when tqdm is imported).
GGUF_CONVERTER = "transformers.modeling_gguf_pytorch_utils"

# Loads run in several threads at once (API queries lazily load the reranker, the embedder);
# the first to enter silences, the last to leave restores.
_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}
_patched_tqdm: dict[str, Any] = {}  # module name -> its original `tqdm`


@contextmanager
def quiet_libraries(tqdm_modules: Sequence[str] = ()) -> Iterator[None]:
    """No transformers/huggingface_hub progress bars and only their errors logged, inside the block.

    Args:
        tqdm_modules: modules that call tqdm directly (e.g. GGUF_CONVERTER); their module-level
            `tqdm` is replaced by a disabled one inside the block. Imported if not yet loaded.

    Other threads' transformers calls are quiet too while the block runs (the switches are global).
    """
    global _depth
    with _lock:
        if _depth == 0:
            _saved.update(_silence())
        _depth += 1
        for name in tqdm_modules:
            _silence_tqdm_in(name)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore(_saved)
                _saved.clear()
                for name, original in _patched_tqdm.items():
                    sys.modules[name].tqdm = original
                _patched_tqdm.clear()


def _silence() -> dict[str, Any]:
    """Turn bars and advice off; returns what was there before."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # nothing of transformers to quiet
        return {}
    hf_logging.get_verbosity()  # configures transformers' root logger, so what we read is its real level
    root = logging.getLogger("transformers")
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    saved = {"level": root.level, "bars": hf_logging.is_progress_bar_enabled(),
             "hub_states": dict(hub_tqdm.progress_bar_states)}
    root.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()  # transformers' bars and huggingface_hub's (downloads)
    return saved


def _restore(saved: dict[str, Any]) -> None:
    if not saved:
        return
    from transformers.utils import logging as hf_logging

    logging.getLogger("transformers").setLevel(saved["level"])
    # transformers' switch has no setter that leaves huggingface_hub alone (enable_progress_bar()
    # also re-enables the hub's, with a warning under HF_HUB_DISABLE_PROGRESS_BARS): set the flag
    # it reads, then the hub's per-group states exactly as they were.
    hf_logging._tqdm_active = saved["bars"]
    hub_states = importlib.import_module("huggingface_hub.utils.tqdm").progress_bar_states
    hub_states.clear()
    hub_states.update(saved["hub_states"])


def _silence_tqdm_in(name: str) -> None:
    if name in _patched_tqdm:
        return
    try:
        module = importlib.import_module(name)
    except ImportError:  # its optional dependency is missing: the load that needs it fails on its own
        return
    original = getattr(module, "tqdm", None)
    if original is None:
        return
    _patched_tqdm[name] = original
    module.tqdm = functools.partial(original, disable=True)
