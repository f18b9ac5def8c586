"""bench/engine_llama8b.py: its settings, the 70B folder, and every section of `--tiny` on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generation.config import ModelConfig
from tests.bench import loaded_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "engine_llama8b.py"
ALL_SECTIONS = "decode,throughput,prefix,overhead,profile,rag-prefill"


@pytest.fixture(scope="module")
def bench():
    yield from loaded_bench("engine_llama8b")


def test_settings_compare_puts_bf16_first(bench):
    settings, notes = bench.resolve_settings("8b", "fp8", "fp8", compare=True)
    assert [s.label for s in settings] == ["bf16", "fp8 + fp8 KV"]
    assert settings[0].engine_args() == {"quantization": None, "kv_cache_dtype": "auto"}
    assert settings[1].engine_args() == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert not notes
    alone, _ = bench.resolve_settings("8b", "fp8", "auto", compare=False)
    assert [s.label for s in alone] == ["fp8"]
    same, _ = bench.resolve_settings("8b", "none", "auto", compare=True)  # nothing to compare with
    assert [s.label for s in same] == ["bf16"]


def test_the_70b_shape_runs_fp8_only(bench):
    settings, notes = bench.resolve_settings("70b", "none", "auto", compare=True)
    assert [s.label for s in settings] == ["fp8"] and notes
    settings, _ = bench.resolve_settings("70b", "none", "fp8", compare=True)
    assert [s.label for s in settings] == ["fp8", "fp8 + fp8 KV"]  # FP8 KV against FP8 weights alone


def test_the_70b_folder_is_a_config_and_its_floor_counts_fp8_weights(bench, tmp_path):
    roofline = sys.modules["roofline"]  # imported by the bench from bench/
    bench.write_config(tmp_path, bench.LLAMA_70B)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no weights: load_format="dummy" makes them
    config = ModelConfig.from_model_dir(tmp_path)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (8192, 28672, 80)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (64, 8, 128256)
    assert config.rope_scaling["rope_type"] == "llama3" and not config.tie_word_embeddings
    bf16 = roofline.decode_bytes(config, 640, 1, 2, dtype=torch.bfloat16)
    fp8 = roofline.decode_bytes(config, 640, 1, 2, dtype=torch.bfloat16, quantization="fp8")
    assert bf16.all_weight_bytes / 1e9 == pytest.approx(141.1, abs=0.2)  # 70.55 B parameters
    # e4m3 decoder layers (68.5 B) plus their scales, the bf16 LM head (2.1 GB) and norms.
    assert fp8.streamed_weight_bytes / 1e9 == pytest.approx(70.6, abs=0.2)
    assert fp8.all_weight_bytes - fp8.streamed_weight_bytes == fp8.embedding_bytes == 128256 * 8192 * 2
    layers, head = roofline.matmul_parameters(config)
    assert (layers + head) / 1e9 == pytest.approx(69.5, abs=0.1)


def table_rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The final markdown table: {(section, measure): {column: cell}}."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| section | measure |"))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        row = dict(zip(columns, cells, strict=True))
        rows[(row["section"], row["measure"])] = row
    return rows


def run_tiny(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(BENCH), "--tiny", "--only", ALL_SECTIONS, "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, json.loads(out.read_text())


def check_floors(figures: dict, label: str) -> None:
    by_measure = figures[label]
    old = next(v for k, v in by_measure.items() if k.startswith("floor: old"))
    honest = next(v for k, v in by_measure.items() if k.startswith("floor: honest"))
    assert not honest["embedding_tied"]
    # The untied input embedding is the only weight decode does not stream.
    assert honest["weight_bytes"] < honest["all_weight_bytes"] == old["bytes"]
    assert honest["weight_bytes"] + honest["embedding_bytes"] == honest["all_weight_bytes"]
    assert honest["bytes"] > honest["weight_bytes"] + honest["kv_bytes"] > honest["weight_bytes"]  # + embedding rows
    assert honest["ms"] == pytest.approx(honest["bytes"] / honest["bandwidth"] * 1e3)
    assert old["ms"] == pytest.approx(old["bytes"] / old["bandwidth"] * 1e3)
    read = next(v for k, v in by_measure.items() if k.startswith("machine: read bandwidth"))
    copy = next(v for k, v in by_measure.items() if k.startswith("machine: copy bandwidth"))
    assert honest["bandwidth"] == read["bytes_per_s"] and old["bandwidth"] == copy["bytes_per_s"]
    decode = next(v for k, v in by_measure.items() if k.startswith("decode: batch 1"))
    assert decode["percent_of_floor"] == pytest.approx(100 * honest["ms"] / decode["ms_per_token"])


@pytest.mark.slow
def test_tiny_runs_every_section_for_bf16_and_fp8_side_by_side(tmp_path):
    stdout, data = run_tiny(tmp_path, "--compare", "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    labels = ["fp32", "fp8 + fp8 KV"]  # on CPU the engine's unquantized dtype is fp32
    assert [s["label"] for s in data["settings"]] == labels
    rows = table_rows(stdout)
    sections = {section for section, _ in rows}
    assert {"machine", "floor", "decode", "throughput", "prefix", "overhead", "profile", "rag-prefill"} <= sections
    for (section, measure), row in rows.items():
        for label in labels:
            assert row[label], f"{section} / {measure}: no figure for {label}"
    assert "old floor: all weights / copy bandwidth = " in stdout and "honest floor: " in stdout
    for label in labels:
        check_floors(data["figures"], label)
    fp32, fp8 = (data["figures"][label] for label in labels)
    honest = next(k for k in fp32 if k.startswith("floor: honest"))
    assert fp8[honest]["weight_bytes"] < fp32[honest]["weight_bytes"] / 2  # e4m3 layers against fp32
    assert fp8[honest]["kv_bytes"] * 4 == fp32[honest]["kv_bytes"]  # e4m3 KV against fp32
    rag = next(k for k in fp32 if k.startswith("rag-prefill"))
    assert fp32[rag]["tokens_per_s"] > 0 and fp32[rag]["flops_per_prompt"] > 0
    assert data["device"].startswith("CPU") and data["torch"] == torch.__version__ and data["date"]
    assert data["table"] in stdout


@pytest.mark.slow
def test_tiny_from_a_written_checkpoint(tmp_path):
    # load_format auto: the checkpoint the HF peers would use is written, then loaded by the engine.
    stdout, data = run_tiny(tmp_path, "--load-format", "auto", "--folder", str(tmp_path / "model"))
    assert any((tmp_path / "model").glob("*.safetensors"))
    assert [s["label"] for s in data["settings"]] == ["fp32"]
    check_floors(data["figures"], "fp32")
    assert ("profile", "decode step GPU time") in table_rows(stdout)
