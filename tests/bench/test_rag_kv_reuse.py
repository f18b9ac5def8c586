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


def test_the_ideal_speed_up_follows_each_chunk_modes_rules(bench):
    # Head 16, label 8, chunk 32, question 8, 3 sources, first block 16: prompts of 144.
    corpus = bench.Corpus(bench.Sizes(120, 32, 3, 8, 4, 16, 8), 1024)
    q = tuple(range(8))
    stream = [bench.Request(ids, q) for ids in ((1, 2, 3), (4, 2, 1), (5, 2, 6), (1, 7, 2))]

    def ideal(mode):
        return bench.ideal_speedup(corpus, [], stream, mode)

    # chunks-inplace, by hand: 1 (rank first) is published as it leads; 2 and 3 miss in place (144
    # computed). Then 2, missed before, leads and publishes itself, 4 misses, 1 costs its first
    # block (104); 5 leads by rank, 2 is reused, 6 misses (104); 1 leads by rank as an exact hit,
    # 7 misses for the first time, 2 is reused (72).
    assert ideal("chunks-inplace") == pytest.approx(576 / (144 + 104 + 104 + 72))
    # A missed chunk leading even at its first miss: 7 leads in the last request, and 1 is reused
    # at its first block (88).
    assert ideal("chunks-inplace-anymiss") == pytest.approx(576 / (144 + 104 + 104 + 88))
    # Rank order: 4 leads in the second, and 2's second miss costs it twice, in place and compiled (136).
    assert ideal("chunks-inplace-rank") == pytest.approx(576 / (144 + 136 + 104 + 72))
    # Label 1 its own segment: nothing publishes itself, every label is computed (144, 192, 112, 96).
    assert ideal("chunks-inplace-split") == pytest.approx(576 / (144 + 192 + 112 + 96))
    # Wait: the first missed chunk leads and is published, other misses are compiled first and
    # reused (176, 88, 120, 88).
    assert ideal("chunks") == pytest.approx(576 / (176 + 88 + 120 + 88))
    assert ideal("no-cache") == 1.0


def test_the_throughput_ideal_is_the_issues_arithmetic(bench):
    # Issue 16: "compute can fall by about 2.4x at most and offline throughput by about 1.75x",
    # i.e. prefill is about 73.5% of no-cache's offline time.
    assert bench.throughput_ideal(2.4, 0.735) == pytest.approx(1.75, abs=0.01)
    assert bench.throughput_ideal(2.4, 1.0) == pytest.approx(2.4)  # all prefill: the prompt-token ideal
    assert bench.throughput_ideal(2.4, 0.0) == 1.0  # all decode: nothing to gain


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
    # Offline throughput is held against its ideal with decode counted (no-cache's prefill share).
    assert "no-cache offline prefill only:" in out.stdout
    assert "chunks-inplace: offline throughput" in out.stdout and "of no-cache's offline time) =" in out.stdout
