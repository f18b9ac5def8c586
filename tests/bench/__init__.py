"""Tests of the benchmark scripts under bench/ (loaded from their files: bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def loaded_bench(name: str) -> Iterator[ModuleType]:
    """bench/NAME.py as a module for a fixture to yield; registered in sys.modules while in use.

    Its dataclasses look their module up in sys.modules, so it is registered there, and removed
    afterwards so that tests of other scripts with the same helper names are not mixed up.
    """
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
