"""bench/rag_kv_reuse.py: its queue-growth measure on hand-computed loads, and its dry run end to end."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rag_kv_reuse.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rag_kv_reuse", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def load(bench, timed):
    return bench.LoadResult(timed, output_tokens=0, seconds=1.0, requests=len(timed))


def test_queue_growth_compares_the_last_third_of_arrivals_with_the_first(bench):
    # Listed in first-token order, not arrival order: the measure sorts by arrival itself.
    growing = [(8.0, 0.7), (0.0, 0.1), (1.0, 0.2), (2.0, 0.3), (3.0, 0.4), (4.0, 0.5), (5.0, 0.6),
               (6.0, 0.9), (7.0, 0.8)]  # fmt: skip
    # First third 0.1, 0.2, 0.3 (p50 0.2); last third 0.9, 0.8, 0.7 (p50 0.8): 4x.
    assert load(bench, growing).queue_growth() == pytest.approx(4.0)
    steady = [(float(i), 0.25) for i in range(12)]
    assert load(bench, steady).queue_growth() == pytest.approx(1.0)
    assert load(bench, steady[:8]).queue_growth() is None  # too few requests to tell
    assert load(bench, growing).ttft == [t for _, t in growing]


@pytest.mark.slow
def test_the_dry_run_prints_the_table_and_the_goals(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--modes", "no-cache,chunks-inplace", "--rates", "0.9x,1.2x",
         "--requests", "12", "--folder", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=600, cwd=BENCH.parents[1],
        env={**os.environ, "PYTHONPATH": str(BENCH.parents[1])},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| chunks-inplace | 1.2x")]
    assert len(rows) == 1 and rows[0].count("|") == 16  # 15 columns, queue growth and host copies out among them
    assert rows[0].split("|")[11].strip() == "-"  # host copies out: no host tier in this mode
    assert "lower than no-cache (goal >= 5x)" in out.stdout
