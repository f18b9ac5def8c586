"""bench/goodput.py: TTFT/TPOT/ITL/goodput from recorded chunk times (by hand), the knee, and --tiny end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import loaded_bench

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "goodput.py"


@pytest.fixture(scope="module")
def bench():
    yield from loaded_bench("goodput")


def test_ttft_tpot_and_itl_of_one_request(bench):
    # Chunks at 0.5 s (1 token), 0.7 s (2 tokens), 1.3 s (3 tokens): 6 tokens in all.
    r = bench.Record(True, chunk_times=[0.5, 0.7, 1.3], chunk_tokens=[1, 2, 3], completion_tokens=6)
    assert r.ttft == 0.5
    assert r.tpot == pytest.approx((1.3 - 0.5) / 5)  # 0.16 s per token after the first
    assert r.itls == pytest.approx([0.2, 0.6])
    assert bench.Record(True, chunk_times=[0.4], chunk_tokens=[1], completion_tokens=1).tpot is None


def test_level_statistics_and_goodput_by_hand(bench):
    records = [
        # meets both: TTFT 1.0 <= 2, TPOT (2.0 - 1.0) / 10 = 0.1 <= 0.2
        bench.Record(True, chunk_times=[1.0, 1.5, 2.0], chunk_tokens=[1, 5, 5], completion_tokens=11),
        # TTFT 3.0 misses
        bench.Record(True, chunk_times=[3.0, 3.5], chunk_tokens=[1, 10], completion_tokens=11),
        # TPOT (7.0 - 0.5) / 10 = 0.65 misses
        bench.Record(True, chunk_times=[0.5, 7.0], chunk_tokens=[1, 10], completion_tokens=11),
        # one token: no TPOT, meets on TTFT alone
        bench.Record(True, chunk_times=[0.2], chunk_tokens=[1], completion_tokens=1),
        bench.Record(False, error="HTTP 500: b''"),  # failed: never good, still counts in the share's total
    ]
    s = bench.level_stats(records, wall=4.0, slo_ttft=2.0, slo_tpot=0.2)
    assert (s["requests"], s["failed"], s["errors"]) == (4, 1, ["HTTP 500: b''"])
    # TTFTs 0.2, 0.5, 1.0, 3.0: nearest-rank p50 = the 2nd, p99 = the 4th.
    assert (s["ttft_p50_s"], s["ttft_p99_s"]) == (0.5, 3.0)
    # TPOTs 0.05 (3.5 - 3.0) / 10, 0.1, 0.65.
    assert s["tpot_p50_s"] == pytest.approx(0.1) and s["tpot_p99_s"] == pytest.approx(0.65)
    # ITLs pooled: 0.5, 0.5, 0.5, 6.5.
    assert s["itl_p50_s"] == pytest.approx(0.5) and s["itl_p99_s"] == pytest.approx(6.5)
    assert s["tokens_per_chunk"] == pytest.approx((5 + 5 + 10 + 10) / 4)
    assert s["request_per_s"] == 1.0 and s["output_tok_per_s"] == pytest.approx(34 / 4)
    assert s["goodput_per_s"] == pytest.approx(2 / 4) and s["goodput_share"] == pytest.approx(2 / 5)


def test_ratios_to_one_client_and_the_knee(bench):
    def lv(tok, p99, failed=0):
        return {"output_tok_per_s": tok, "ttft_p99_s": p99, "failed": failed}

    levels = {1: lv(100.0, 0.1), 8: lv(600.0, 0.9), 32: lv(1500.0, 1.9), 64: lv(1600.0, 4.0), 128: lv(1650.0, 9.0)}
    bench.add_ratios(levels)
    assert [levels[c]["x_serialized"] for c in (1, 8, 32)] == [1.0, 6.0, 15.0]
    assert bench.knee(levels, 2.0) == 32
    assert bench.knee(levels, 0.05) is None
    levels[32]["failed"] = 1  # a level with failures is not within the SLO
    assert bench.knee(levels, 2.0) == 8


def test_prometheus_samples_and_engine_args(bench):
    text = ("# HELP rag_engine_num_requests_waiting x\n# TYPE rag_engine_num_requests_waiting gauge\n"
            "rag_engine_num_requests_waiting 3.0\nrag_engine_kv_cache_usage_ratio 0.25\n"
            'rag_engine_time_to_first_token_seconds_bucket{le="0.1"} 2.0\n')
    got = bench.prometheus_values(text, ("rag_engine_num_requests_waiting", "rag_engine_kv_cache_usage_ratio"))
    assert got == {"rag_engine_num_requests_waiting": 3.0, "rag_engine_kv_cache_usage_ratio": 0.25}
    assert bench.parse_engine_args("quantization=fp8, max_num_seqs=128") == {"quantization": "fp8",
                                                                             "max_num_seqs": "128"}
    args = bench.parse_args(["--dummy-shape", "llama-8b", "--compare-dtypes", "--engine-args", "max_num_seqs=128",
                             "--device", "cuda"])
    assert bench.settings_of(args, {"load_format": "dummy", "max_num_seqs": "128"}) == [
        ("bf16", {"load_format": "dummy", "max_num_seqs": "128"}),
        ("fp8", {"load_format": "dummy", "max_num_seqs": "128", "quantization": "fp8", "kv_cache_dtype": "fp8"})]
    assert args.concurrency_list == [1, 8, 32, 64, 128] and (args.input_len, args.output_len) == (2048, 256)
    assert bench.level_sizes([1, 8, 32], per_client=2, minimum=8) == {1: 8, 8: 16, 32: 64}


@pytest.mark.slow
def test_tiny_sweep_compares_two_settings_end_to_end(tmp_path):
    out = tmp_path / "goodput.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # The GPU run's shape on the CPU: two server processes (as given, then fp8 weights and KV), both workloads.
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--compare-dtypes", "--concurrency", "1,3",
                           "--work", str(tmp_path), "--engine-args", "max_num_seqs=4", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(s["label"], s["engine_args"], s.get("error")) for s in result["settings"]] == [
        ("fp32", {"max_num_seqs": "4"}, None),
        ("fp8", {"max_num_seqs": "4", "quantization": "fp8", "kv_cache_dtype": "fp8"}, None)]
    for setting in result["settings"]:
        for name in ("random", "rag"):
            levels = setting["workloads"][name]["levels"]
            assert sorted(levels) == ["1", "3"]
            for c, lv in levels.items():
                assert lv["failed"] == 0 and lv["requests"] == max(4, 2 * int(c))
                assert lv["completion_tokens"] == 8 * lv["requests"]  # ignore_eos: every answer the full length
                assert lv["tokens_per_chunk"] == 1.0  # one step per batch on the CPU
                assert 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"] and lv["tpot_p50_s"] > 0
                assert lv["metrics_samples"] >= 1  # GET /metrics answered while the level ran
            assert levels["1"]["x_serialized"] == 1.0
    assert "| clients | requests | TTFT p50 ms" in proc.stdout and "knee (highest concurrency" in proc.stdout
    assert "| workload | clients | fp32 | fp8 | fp8 / fp32 |" in proc.stdout
    assert "CPUs usable" in proc.stdout  # the hardware line
    assert out.with_suffix(".png").is_file() or "matplotlib is not importable" in proc.stdout
