"""A test-suite speed-up: CPU forward passes of the embedder and the reranker, memoized on disk.

The end-to-end tests ingest the same sample corpus into dozens of fresh data directories, through
the Python API, the CLI and servers in subprocesses, and ask the same questions again; on two cores
the encoder's matmuls are most of that time. With ``RAG_TEST_FORWARD_MEMO`` naming a folder, a
forward pass on a CPU is looked up by everything that decides its output: the model (a fingerprint
of its configuration and weights), the dtype and autocast, the pooling, and the exact input
tensors of the batch, padding included. A hit returns the array the real model computed for that
exact batch earlier in the session, bit for bit what recomputing it on the same machine gives;
so the memo can only hide a difference that recomputation itself would show (thread counts, a
nondeterministic kernel), and the tests of those properties (tests/ingest/test_embed.py,
tests/retrieval/test_rerank.py, the batching tests) run without it.

It is off unless the variable is set, never used on a GPU, and fails soft: a folder that cannot be
read or written (a test that drops to nobody) means computing as usual. Files are owner-only.
Not for production: the folder holds vectors of every text and question it saw.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a base module: only the standard library at the top (tests/test_layering.py)
    import numpy as np

ENV = "RAG_TEST_FORWARD_MEMO"
# Bytes of each parameter that go into a model's fingerprint: its head and tail tell apart any two
# checkpoints the suite loads (converted, random tiny, fine-tuned), without hashing every weight.
_SAMPLE_BYTES = 4096


def memo_folder() -> Path | None:
    """The memo's folder when the environment names one, else None (memo off)."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def model_fingerprint(model) -> str:
    """A digest of a torch module's class, configuration and a sample of every parameter."""
    import torch

    digest = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(raw[:_SAMPLE_BYTES].tobytes())
        digest.update(raw[-_SAMPLE_BYTES:].tobytes())
    return digest.hexdigest()


def batch_key(fingerprint: str, settings: str, arrays: Sequence[np.ndarray]) -> str:
    """The key of one forward pass: the model, how it runs, and the exact input arrays."""
    import numpy as np

    digest = hashlib.sha256(f"{fingerprint}|{settings}".encode())
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"|{array.dtype}:{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def memoized(folder: Path, key: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The array stored under key, else compute() stored there (atomically) and returned."""
    import numpy as np

    path = folder / key[:2] / f"{key}.npy"
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):  # absent, unreadable (another user), or half-written by a crash
        pass
    result = compute()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # created 0600
        with os.fdopen(fd, "wb") as f:
            np.save(f, result, allow_pickle=False)
        os.replace(tmp, path)  # readers see the old state or the whole array
    except OSError:
        pass
    return result
