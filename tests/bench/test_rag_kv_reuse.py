"""bench/rag_kv_reuse.py: its queue growth, its ideal (kv_reuse_bound) and SLO sweep by hand, and its dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import loaded_bench

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rag_kv_reuse.py"


@pytest.fixture(scope="module")
def bench():
    yield from loaded_bench("rag_kv_reuse")


def table(stdout, header):
    """The rows of the markdown table whose header line starts with `header`, as dicts by column."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, [c.strip() for c in line.strip("|").split("|")], strict=True)))
    return rows


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


# Head 16, label 16, chunk 32, question 8, 3 sources, block 16 (so a first block is 16): prompts of 168.
SIZES = dict(num_chunks=120, chunk_tokens=32, sources=3, question_tokens=8, answer_tokens=4, head_tokens=16,
             label_tokens=16)  # fmt: skip
STREAM = ((1, 2, 3), (4, 2, 1), (5, 2, 6), (1, 7, 2))


def least(bench, mode, history=(), stream=STREAM):
    sizes = bench.Sizes(**SIZES)
    q = tuple(range(8))
    bound = bench.least_computed(sizes, [bench.Request(c, q) for c in history],
                                 [bench.Request(c, q) for c in stream], mode)  # fmt: skip
    assert bound.prompt_tokens == 168 * len(stream)
    return bound.least_computed


def test_the_exact_bound_counts_every_exact_prefix_and_the_label_after_it(bench):
    # Rank order: the first request computes everything (168); the next two share no leading source
    # with an earlier one, but head and label 1 are cached (136 each); the last leads with 1, as the
    # first did: head, 1 and label 2 are cached (88).
    assert least(bench, "exact-rank") == 168 + 136 + 136 + 88
    # Any order: the second shares {1, 2} with the first, so a cache-aware order can have both and
    # label 3 cached (40); the third shares one chunk (88); the last {1, 2} again (40).
    assert least(bench, "exact-aware") == 168 + 40 + 88 + 40
    assert least(bench, "no-cache") == 4 * 168


def test_the_chunk_bound_takes_the_best_lead_and_charges_first_blocks_and_misses(bench):
    # In place, by hand. 1st: the head; one new chunk leads and publishes itself, two are computed
    # in place, and 2 (retrieved again later) will be computed once more (charged here): 200. 2nd:
    # lead 2 or 1 (exact hit, label 2 cached), the other's first block, new 4 in place, label 3: 72.
    # 3rd: lead 2, 5 and 6 in place, label 3: 88. 4th: lead 2 then 1, an exact prefix an earlier
    # request could have left (the first, led by 2), label 3 cached; 7 in place: 40.
    assert least(bench, "chunks-inplace") == 200 + 72 + 88 + 40
    assert least(bench, "chunks-inplace-anymiss") == least(bench, "chunks-inplace")  # same rules, other policy
    # Wait: a new chunk not in the lead is compiled and then reused, its first block recomputed:
    # 200 (16 less for no second computation of 2, 16 more per compiled chunk), 88, 120, 56.
    assert least(bench, "chunks") == 200 + 88 + 120 + 56
    # Rank order: 2, computed in place in the first (168), costs its second miss twice in the second
    # (in place and compiled: 152); 120; the last leads with 1 as the first did (72).
    assert least(bench, "chunks-inplace-rank") == 168 + 152 + 120 + 72
    # Label 1 after the head: no source sits at its canonical position, every first miss is in place,
    # every second miss in place and compiled: 168, 200, 120, 72.
    assert least(bench, "chunks-inplace-split") == 168 + 200 + 120 + 72
    # ... and "wait" in that layout (the bench's chunks before 2026-12-03): 216, 120, 152, 88.
    assert least(bench, "chunks-split") == 216 + 120 + 152 + 88


def test_the_in_place_bound_charges_what_the_history_left_uncompiled(bench):
    # The first request ran before: of its new chunks 1 and 2, both retrieved next by the counted
    # one, at most one led there; the other is computed again in the stream (32) besides its 72.
    assert least(bench, "chunks-inplace", STREAM[:1], STREAM[1:2]) == 32 + 72
    assert least(bench, "chunks", STREAM[:1], STREAM[1:2]) == 88  # wait compiled them all


def test_the_bound_needs_whole_blocks(bench):
    sizes = bench.Sizes(**{**SIZES, "label_tokens": 8})
    with pytest.raises(ValueError, match="label_tokens"):
        bench.least_computed(sizes, [], [bench.Request((1, 2, 3), ())], "exact-rank")
    with pytest.raises(ValueError, match="no bound"):
        bench.least_computed(bench.Sizes(**SIZES), [], [], "chunks-fraction")


def test_the_slo_sweep_bisects_to_the_crossing_rate():
    from bench.slo_sweep import Probe, Slo, crossing, sweep

    slo = Slo(ttft_ms=1000, quantile=0.99, max_growth=1.25)
    assert slo.miss(900.0, 1.1) is None
    assert slo.miss(1200.0, 1.0) == "p99 1200 ms"
    assert slo.miss(500.0, 1.6) == "queue growth 1.60x"  # a growing queue misses it given time

    def probe(i, rate):
        return Probe(rate, 100.0, 1.0, None if rate <= 10.0 else "over")

    probes = sweep(probe, 1.0, 100.0, 6)
    met, missed = crossing(probes)
    assert probes[0].rate == pytest.approx(10.0) and probes[0].met  # sqrt(1 * 100)
    assert met.rate <= 10.0 < missed.rate and missed.rate / met.rate <= 100 ** (1 / 2**6) + 1e-9
    assert crossing([Probe(5.0, 1.0, None, None)]) == (Probe(5.0, 1.0, None, None), None)
    with pytest.raises(ValueError):
        Slo(ttft_ms=0)


def test_the_throughput_ideal_is_the_issues_arithmetic(bench):
    # Issue 16: "compute can fall by about 2.4x at most and offline throughput by about 1.75x",
    # i.e. prefill is about 73.5% of no-cache's offline time.
    assert bench.throughput_ideal(2.4, 0.735) == pytest.approx(1.75, abs=0.01)
    assert bench.throughput_ideal(2.4, 1.0) == pytest.approx(2.4)  # all prefill: the prompt-token ideal
    assert bench.throughput_ideal(2.4, 0.0) == 1.0  # all decode: nothing to gain


@pytest.mark.slow
def test_the_dry_run_prints_the_table_and_the_goals_and_no_mode_beats_its_bound(tmp_path):
    modes = "no-cache,exact-rank,exact-aware,chunks,chunks-inplace,chunks-inplace-rank,chunks-inplace-split," \
            "chunks-inplace-anymiss"  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--modes", modes, "--loads", "seq,offline,rates,slo",
         "--rates", "1.2x", "--requests", "12", "--slo-probes", "2", "--slo-ms", "100",
         "--folder", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=900, cwd=BENCH.parents[1],
        env={**os.environ, "PYTHONPATH": str(BENCH.parents[1])},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = table(out.stdout, "| mode | load |")
    assert {(r["mode"], r["load"].split()[0]) for r in rows} == {(m, load) for m in modes.split(",")
                                                                 for load in ("seq", "offline", "1.2x")}  # fmt: skip
    for row in rows:
        # No run computes fewer prompt tokens than the bound: measured / ideal speed-up <= 100%.
        assert int(row["prompt tokens computed"]) >= int(row["least computable"]), row
        assert int(row["of ideal"].rstrip("%")) <= 100, row
        assert row["host copies out"] == "-"  # no host tier in these modes
    assert "BELOW THE BOUND" not in out.stdout
    # The SLO sweep: a row per mode, with its two probes.
    slo = table(out.stdout, "| mode | meets the SLO up to")
    assert [r["mode"] for r in slo] == modes.split(",")
    assert all(r["probes (req/s: met / missed)"].count(",") == 1 for r in slo)
    # Sequential wall time beside the TTFT; offline held against its ideal with decode counted.
    assert "chunks-inplace seq: submit() p50" in out.stdout and "wall (submit until the engine is idle" in out.stdout
    assert "chunks-inplace: sequential wall time" in out.stdout
    assert "no-cache offline prefill only:" in out.stdout
    assert "chunks-inplace: offline throughput" in out.stdout and "of no-cache's offline time) =" in out.stdout
