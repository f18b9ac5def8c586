"""Benchmark the generation engine on a Llama-3.1-8B-shaped model (random weights), bf16 and FP8, or the 70B shape.

Every figure is printed beside its peer measured in the same run:
  decode       batch-1 decode (512-token prompt, 256 new tokens): ms/token, ours vs Hugging Face
               `generate` vs the honest bandwidth floor (bench/roofline.py: the bytes a step reads,
               weights without the untied input embedding plus the KV it attends over, divided by
               the read bandwidth of an 8 GiB `torch.sum` of this run; the old floor, all weights
               over the copy bandwidth, is printed once for reference).
  throughput   N prompts, input and output lengths uniform in 100-1024 (ignore_eos): output
               tokens/s, ours vs HF `generate` in padded batches (HF on a subsample, rate compared).
  prefix       time to first token of a 4,096-token prompt, cold vs with its first 4,000 tokens
               cached.
  overhead     the cost of the prefix cache with no reuse (cache on vs off, distinct prompts).
  profile      GPU time of decode steps (graph replays) and of the eager short prefill, fused
               kernels on vs off (bench/engine_profile.py), beside each step's floor (CUDA only).
  rag-prefill  RAG-shaped prefill: N prompts of 5 x 512-token random sources + a 64-token
               question, no prefix cache, all queued at once, max_tokens=1: prompt tokens/s and
               its share of the matmul peak measured in this run (8192^3 bf16 torch.matmul, e4m3
               torch._scaled_mm where the GPU has it).

Weights are random and made on the device from config.json alone (load_format="dummy"): no
checkpoint is written unless the Hugging Face peers need one (8B without --skip-hf). Settings:
`--quantization fp8` (e4m3 linear layers), `--kv-cache-dtype fp8`; `--compare` runs bf16 first,
then the chosen setting, each engine freed before the next, and prints their figures side by
side. `--shape 70b` is Llama-3.1-70B (only FP8 weights fit one GPU: it implies
--quantization fp8, no HF peers, no bf16). `--tiny` runs every section on CPU in seconds (a
2-layer model, prompts scaled down): a check of the code paths, not a measurement.

    PYTHONPATH=. python bench/engine_llama8b.py [--only decode,throughput,prefix,overhead,profile,rag-prefill]
        [--quantization none|fp8] [--kv-cache-dtype auto|fp8] [--compare] [--shape 8b|70b]
        [--prompts 1000] [--rag-prompts 128] [--hf-prompts 32 | --skip-hf] [--folder DIR] [--json PATH] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings: roofline, engine_profile

from roofline import (  # noqa: E402
    PREFILL_FLOPS_FORMULA,
    DecodeFloor,
    copy_bandwidth,
    decode_bytes,
    percent_of_floor,
    prefill_flops,
    read_bandwidth,
    si,
)

from generation import LLM, SamplingParams  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rope_scaling=LLAMA3_ROPE,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}  # fmt: skip
# --tiny: the code paths on CPU in seconds (head_dim 16, 2 KV heads).
LLAMA_TINY = {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
SHAPES = {"8b": LLAMA_8B, "70b": LLAMA_70B, "tiny": LLAMA_TINY}
SECTIONS = ("decode", "throughput", "prefix", "overhead", "profile", "rag-prefill")
DEFAULT_SECTIONS = "decode,throughput,prefix,overhead"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Token counts of every section; `tiny()` scales them down for the CPU check."""

    decode_prompt: int = 512
    decode_new: int = 256
    io_min: int = 100  # throughput input and output lengths, uniform in [io_min, io_max]
    io_max: int = 1024
    prefix_cached: int = 4000
    prefix_tail: int = 96
    overhead_prompts: int = 200
    overhead_new: int = 64
    rag_sources: int = 5
    rag_source_tokens: int = 512
    rag_question: int = 64
    max_model_len: int = 4608
    max_num_batched_tokens: int = 8192
    hf_batch: int = 32
    matmul_n: int = 8192
    read_gib: float = 8
    copy_gib: float = 2
    reps: int = 10

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(decode_prompt=16, decode_new=8, io_min=4, io_max=24, prefix_cached=64, prefix_tail=16,
                   overhead_prompts=6, overhead_new=4, rag_sources=5, rag_source_tokens=16, rag_question=8,
                   max_model_len=256, max_num_batched_tokens=256, hf_batch=4, matmul_n=128, read_gib=1 / 64,
                   copy_gib=1 / 64, reps=3)  # fmt: skip

    @property
    def rag_prompt_len(self) -> int:
        return self.rag_sources * self.rag_source_tokens + self.rag_question


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine configuration of the run: weight quantization and KV cache dtype."""

    quantization: str  # "none" | "fp8"
    kv_cache_dtype: str  # "auto" | "fp8"
    base_dtype: str = "bf16"  # what "none"/"auto" mean on this device (fp32 on CPU)

    @property
    def label(self) -> str:
        weights = "fp8" if self.quantization == "fp8" else self.base_dtype
        return weights if self.kv_cache_dtype == "auto" else f"{weights} + fp8 KV"

    def engine_args(self) -> dict[str, Any]:
        return {"quantization": None if self.quantization == "none" else self.quantization,
                "kv_cache_dtype": self.kv_cache_dtype}  # fmt: skip


def resolve_settings(shape: str, quantization: str, kv_cache_dtype: str, compare: bool, base_dtype: str = "bf16"
                     ) -> tuple[list[Setting], list[str]]:  # fmt: skip
    """The settings to run, in order, and notes on what the shape changed.

    --compare puts bf16 (no quantization, KV in the model's dtype) first; the 70B shape runs only
    FP8 weights (bf16 does not fit one GPU), so its baseline is FP8 weights with the KV dtype "auto".
    """
    notes = []
    if shape == "70b":
        if quantization != "fp8":
            notes.append("--shape 70b: FP8 weights (bf16 weights, 141 GB, fit no single GPU)")
        quantization = "fp8"
        baseline = Setting("fp8", "auto", base_dtype)
        if compare:
            notes.append("--shape 70b --compare: the baseline is FP8 weights with KV auto (no bf16 run)")
    else:
        baseline = Setting("none", "auto", base_dtype)
    chosen = Setting(quantization, kv_cache_dtype, base_dtype)
    settings = [baseline, chosen] if compare and chosen != baseline else [chosen]
    return settings, notes


def write_config(folder: Path, shape: dict[str, Any]) -> None:
    """config.json of a Llama model of `shape`, all that load_format="dummy" reads."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape).save_pretrained(folder)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"no config.json written to {folder}")


def make_checkpoint(folder: Path, shape: dict[str, Any], device: torch.device) -> int:
    """Write random bf16 weights of `shape` (the HF peers need a checkpoint); returns the weight bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    for p in model.parameters():  # small weights keep activations finite
        torch.nn.init.normal_(p, std=0.02)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    del model
    free_memory(device)
    return n_bytes


def make_model(folder: Path) -> int:
    """Write random bf16 weights of the 8B shape on the GPU (bench/serve_load.py, bench/rag_kv_reuse.py)."""
    return make_checkpoint(folder, LLAMA_8B, torch.device("cuda"))


def free_memory(device: torch.device) -> None:
    gc.unfreeze()  # the engine freezes its start-up heap (startup_heap.py); it must be collectable
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, n: int, reps: int = 10) -> float:
    """FLOP/s of an n×n×n bf16 torch.matmul, best of `reps` timings of 10 back-to-back products."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return _best_rate(lambda: a @ b, 2.0 * n**3, device, reps)


def fp8_matmul_peak(device: torch.device, n: int, reps: int = 10) -> tuple[float | None, str]:
    """FLOP/s of an n³ e4m3 torch._scaled_mm (per-tensor scales, bf16 out), or (None, why not)."""
    if not hasattr(torch, "_scaled_mm"):
        return None, "torch has no _scaled_mm"
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        mm()
    except (RuntimeError, NotImplementedError) as exc:
        return None, f"_scaled_mm not available here ({str(exc).splitlines()[0][:80]})"
    return _best_rate(mm, 2.0 * n**3, device, reps), "torch._scaled_mm e4m3"


def _best_rate(fn: Callable[[], Any], work: float, device: torch.device, reps: int, inner: int = 10) -> float:
    fn()
    best = 0.0
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = max(best, inner * work / (time.perf_counter() - t))
    return best


def hf_generate_time(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Seconds for HF generate on one left-padded batch producing exactly new_tokens each."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    sync(device)
    return time.perf_counter() - t


class Results:
    """Figures by (section, measure) and setting: the markdown table and the JSON of the run."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.keys: list[tuple[str, str]] = []
        self.text: dict[tuple[str, str], dict[str, str]] = {}
        self.numbers: dict[str, dict[str, dict[str, float]]] = {label: {} for label in labels}

    def add(self, section: str, measure: str, label: str, text: str, **numbers: float) -> None:
        key = (section, measure)
        if key not in self.text:
            self.keys.append(key)
            self.text[key] = {}
        self.text[key][label] = text
        if numbers:
            self.numbers.setdefault(label, {})[f"{section}: {measure}"] = dict(numbers)

    def add_all(self, section: str, measure: str, text: str, **numbers: float) -> None:
        """A figure of the machine, not of a setting: one measurement shown in every column."""
        for label in self.labels:
            self.add(section, measure, label, text, **numbers)

    def markdown(self) -> str:
        lines = ["| section | measure | " + " | ".join(self.labels) + " |",
                 "|---|---|" + "---|" * len(self.labels)]  # fmt: skip
        for key in self.keys:
            cells = [self.text[key].get(label, "") for label in self.labels]
            lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def engine_kv_bytes(llm: LLM) -> int:
    """Bytes per element of the engine's KV cache tensor (2 for bf16, 1 for e4m3)."""
    return llm.engine.model_runner.kv_cache.element_size()


def check_setting_applied(llm: LLM, setting: Setting) -> None:
    """Refuse to report figures under a label the engine did not run (an ignored engine field)."""
    fp8_params = sum(p.numel() for p in llm.model.parameters() if p.dtype == torch.float8_e4m3fn)
    if setting.quantization == "fp8" and not fp8_params:
        raise SystemExit(f"{setting.label}: the engine built no e4m3 weights (quantization='fp8' not applied)")
    if setting.quantization == "none" and fp8_params:
        raise SystemExit(f"{setting.label}: the engine built e4m3 weights without quantization")
    kv = engine_kv_bytes(llm)
    if setting.kv_cache_dtype == "fp8" and kv != 1:
        raise SystemExit(f"{setting.label}: the KV cache has {kv}-byte elements (kv_cache_dtype='fp8' not applied)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=DEFAULT_SECTIONS, help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--prompts", type=int, default=None, help="throughput prompts (1000; 8 with --tiny)")
    ap.add_argument("--rag-prompts", type=int, default=None, help="rag-prefill prompts (128; 4 with --tiny)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine concurrency (decode batch ceiling)")
    ap.add_argument("--hf-prompts", type=int, default=32, help="subsample for the HF throughput peer")
    ap.add_argument("--skip-hf", action="store_true", help="no Hugging Face peers (quick runs)")
    ap.add_argument("--folder", default=None, help="model folder (config.json; a checkpoint for the HF peers)")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--compare", action="store_true", help="bf16 first, then the chosen setting, side by side")
    ap.add_argument("--shape", choices=["8b", "70b"], default="8b")
    ap.add_argument(
        "--load-format",
        choices=["dummy", "auto"],
        default="dummy",
        help="dummy: random weights from config.json on the device; auto: a checkpoint (written if absent)",
    )
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--separate-fp8-quant", action="store_true",
                    help="quantize FP8 inputs in launches of their own, not inside the norms / SiLU-and-mul")
    ap.add_argument("--tiny", action="store_true", help="every section on CPU in seconds (a check, not a measurement)")
    ap.add_argument("--child-overhead", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.separate_fp8_quant:
        from generation.layers.kernel_choice import set_fp8_producer_quantize

        set_fp8_producer_quantize(False)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; valid: {', '.join(SECTIONS)}")
    if args.prompts is None:
        args.prompts = 8 if args.tiny else 1000
    if args.rag_prompts is None:
        args.rag_prompts = 4 if args.tiny else 128
    shape_name = "tiny" if args.tiny else args.shape
    sizes = Sizes.tiny() if args.tiny else Sizes()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.child_overhead:
        return child_overhead(args, sizes, device, shape_name)
    run(args, set(only), shape_name, sizes, device)


def engine(folder: Path, args: argparse.Namespace, sizes: Sizes, device: torch.device, setting: Setting,
           prefix_caching: bool) -> LLM:  # fmt: skip
    return LLM(folder, device=str(device), max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=sizes.max_num_batched_tokens, max_model_len=sizes.max_model_len,
               load_format=args.load_format, enable_prefix_caching=prefix_caching,
               **setting.engine_args())  # fmt: skip


def run(args: argparse.Namespace, only: set[str], shape_name: str, sizes: Sizes, device: torch.device) -> None:
    shape = SHAPES[shape_name]
    skip_hf = args.skip_hf or args.tiny or shape_name == "70b"
    base_dtype = "bf16" if device.type == "cuda" else "fp32"  # the engine's default dtype on the device
    settings, notes = resolve_settings(shape_name, args.quantization, args.kv_cache_dtype, args.compare, base_dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--tiny: not a measurement)"
    now = datetime.datetime.now()
    header = f"# {device_name}, torch {torch.__version__}, {now:%Y-%m-%d %H:%M}, shape {shape_name}"
    print(header, flush=True)
    for note in notes:
        print(note)
    results = Results([s.label for s in settings])

    folder = Path(args.folder or tempfile.mkdtemp(prefix=f"llama{shape_name}-"))
    has_weights = any(folder.glob("*.safetensors"))
    hf_runs = not skip_hf and bool(only & {"decode", "throughput"})
    needs_checkpoint = hf_runs or args.load_format == "auto"
    if needs_checkpoint and not has_weights:
        if shape_name == "70b":
            raise SystemExit("--shape 70b writes no checkpoint: use --load-format dummy")
        make_checkpoint(folder, shape, device)
    elif not (folder / "config.json").exists():
        write_config(folder, shape)

    # The machine: read and copy bandwidth before any engine holds memory; the matmul peaks.
    read_bw = read_bandwidth(device, sizes.read_gib, sizes.reps)
    copy_bw = copy_bandwidth(device, sizes.copy_gib, sizes.reps)
    print(f"read bandwidth (sum over {sizes.read_gib:g} GiB) {si(read_bw, 'B/s')}; "
          f"copy bandwidth {si(copy_bw, 'B/s')} (read + write counted)", flush=True)  # fmt: skip
    free_memory(device)  # the allocator's cached blocks would count as used when the engine sizes its KV cache
    results.add_all("machine", f"read bandwidth (torch.sum over {sizes.read_gib:g} GiB, best of {sizes.reps})",
                    si(read_bw, 'B/s'), bytes_per_s=read_bw)  # fmt: skip
    results.add_all("machine", "copy bandwidth (read + write counted)", si(copy_bw, 'B/s'),
                    bytes_per_s=copy_bw)  # fmt: skip
    peaks: dict[str, float] = {}
    if "rag-prefill" in only:
        n = sizes.matmul_n
        peaks["bf16"] = matmul_peak(device, n, sizes.reps)
        results.add_all("machine", f"bf16 matmul peak ({n}³ torch.matmul)", si(peaks['bf16'], 'FLOP/s'),
                        flops_per_s=peaks["bf16"])  # fmt: skip
        fp8_peak, how = fp8_matmul_peak(device, n, sizes.reps)
        if fp8_peak is not None:
            peaks["fp8"] = fp8_peak
            results.add_all("machine", f"fp8 matmul peak ({n}³ {how})", si(fp8_peak, 'FLOP/s'),
                            flops_per_s=fp8_peak)  # fmt: skip
        else:
            results.add_all("machine", "fp8 matmul peak", f"n/a: {how}")
        print("matmul peaks: " + ", ".join(f"{k} {si(v, 'FLOP/s')}" for k, v in peaks.items())
              + ("" if fp8_peak else f"; fp8: {how}"), flush=True)  # fmt: skip
        free_memory(device)

    rng = random.Random(0)
    vocab = shape["vocab_size"]

    def rand_prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prompt_decode = rand_prompt(sizes.decode_prompt)
    thr_prompts = [rand_prompt(rng.randint(sizes.io_min, sizes.io_max)) for _ in range(args.prompts)]
    thr_outs = [rng.randint(sizes.io_min, sizes.io_max) for _ in range(args.prompts)]

    # Peers first: Hugging Face generate on the bf16 checkpoint (freed before our engine starts).
    if hf_runs:
        hf_peers(folder, only, args, sizes, device, prompt_decode, thr_prompts, thr_outs, results, settings[0])

    for setting in settings:
        print(f"\n## {setting.label} (quantization {setting.quantization}, KV cache {setting.kv_cache_dtype})",
              flush=True)  # fmt: skip
        if "overhead" in only:
            overhead(args, folder, setting, results)
        if only & {"decode", "throughput", "prefix", "profile", "rag-prefill"}:
            run_setting(args, only, folder, sizes, device, setting, results, read_bw, copy_bw, peaks, rand_prompt,
                        prompt_decode, thr_prompts, thr_outs)  # fmt: skip
        free_memory(device)

    table = results.markdown()
    print(f"\n{header}\n\n{table}\n\nrag-prefill: {PREFILL_FLOPS_FORMULA}; the share is of the setting's own "
          "matmul peak (fp8 for FP8 weights, though attention and the LM head run in bf16)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device_name, "torch": torch.__version__, "date": now.isoformat(timespec="seconds"),
            "shape": shape_name, "config": shape, "sections": sorted(only), "notes": notes,
            "settings": [dataclasses.asdict(s) | {"label": s.label} for s in settings],
            "figures": results.numbers, "table": table, "prefill_flops_formula": PREFILL_FLOPS_FORMULA,
        }, indent=2))  # fmt: skip
        print(f"wrote {args.json}")


def hf_peers(folder: Path, only: set[str], args: argparse.Namespace, sizes: Sizes, device: torch.device,
             prompt_decode: list[int], thr_prompts: list[list[int]], thr_outs: list[int], results: Results,
             setting: Setting) -> None:  # fmt: skip
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    hf.eval()
    if "decode" in only:
        hf_generate_time(hf, [prompt_decode], 8, device)
        hf_ms = hf_generate_time(hf, [prompt_decode], sizes.decode_new, device) * 1000 / sizes.decode_new
        results.add("decode", "HF generate (SDPA, bf16), batch 1", setting.label, f"{hf_ms:.2f} ms/token",
                    ms_per_token=hf_ms)  # fmt: skip
    if "throughput" in only:
        sub = list(range(min(args.hf_prompts, len(thr_prompts))))
        n_out, t_total = 0, 0.0
        for start in range(0, len(sub), sizes.hf_batch):  # padded batches, each run to its longest output
            idx = sub[start : start + sizes.hf_batch]
            t_total += hf_generate_time(hf, [thr_prompts[i] for i in idx], max(thr_outs[i] for i in idx), device)
            n_out += sum(thr_outs[i] for i in idx)  # useful tokens only
        rate = n_out / t_total
        results.add("throughput", f"HF generate, padded batches of {sizes.hf_batch} ({len(sub)}-prompt subsample)",
                    setting.label, f"{rate:,.0f} useful tok/s", tokens_per_s=rate)  # fmt: skip
    del hf
    free_memory(device)


def overhead(args: argparse.Namespace, folder: Path, setting: Setting, results: Results) -> None:
    """The prefix cache with no reuse at all: distinct prompts, cache on vs off, each engine in its own process."""
    times = {}
    for flag in ("on", "off"):
        cmd = [
            sys.executable,
            __file__,
            "--child-overhead",
            flag,
            "--folder",
            str(folder),
            "--quantization",
            setting.quantization,
            "--kv-cache-dtype",
            setting.kv_cache_dtype,
            "--load-format",
            args.load_format,
            "--shape",
            args.shape,
            "--max-num-seqs",
            str(args.max_num_seqs),
        ]
        if args.tiny:
            cmd.append("--tiny")  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"overhead child ({flag}, {setting.label}) failed:\n{proc.stderr[-3000:]}")
        times[flag] = float(proc.stdout.strip().splitlines()[-1])
    cost = (times["on"] / times["off"] - 1) * 100
    print(f"prefix cache with no reuse (distinct prompts): {times['on']:.2f} s on vs {times['off']:.2f} s off "
          f"({cost:+.1f}%)", flush=True)  # fmt: skip
    results.add("overhead", "prefix cache with no reuse (distinct prompts), on vs off", setting.label,
                f"{times['on']:.2f} s vs {times['off']:.2f} s ({cost:+.1f}%)", on_s=times["on"], off_s=times["off"],
                cost_percent=cost)  # fmt: skip


def child_overhead(args: argparse.Namespace, sizes: Sizes, device: torch.device, shape_name: str) -> None:
    rng = random.Random(1)
    vocab = SHAPES[shape_name]["vocab_size"]
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(sizes.io_min, sizes.io_max))]
               for _ in range(sizes.overhead_prompts)]  # fmt: skip
    params = SamplingParams(max_tokens=sizes.overhead_new, ignore_eos=True)
    setting = Setting(args.quantization, args.kv_cache_dtype)
    e = engine(Path(args.folder), args, sizes, device, setting, prefix_caching=args.child_overhead == "on")
    e.generate([[5] * 64] * 4, params)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        e.generate(prompts, params)
        best = min(best, time.perf_counter() - t)
        if args.child_overhead == "on":  # so the second pass cannot reuse the first pass's blocks
            e.engine.block_manager.reset_prefix_cache()
    print(best)


def run_setting(args: argparse.Namespace, only: set[str], folder: Path, sizes: Sizes, device: torch.device,
                setting: Setting, results: Results, read_bw: float, copy_bw: float, peaks: dict[str, float],
                rand_prompt: Callable[[int], list[int]], prompt_decode: list[int], thr_prompts: list[list[int]],
                thr_outs: list[int]) -> None:  # fmt: skip
    label = setting.label
    # The prefix section needs the cache; without it the engine runs as rag-prefill wants (no cache),
    # so one engine serves every section.
    prefix_caching = "prefix" in only
    t = time.perf_counter()
    llm = engine(folder, args, sizes, device, setting, prefix_caching)
    check_setting_applied(llm, setting)
    runner = llm.engine.model_runner
    print(f"engine ({label}): built in {time.perf_counter() - t:.1f} s; max_num_seqs {args.max_num_seqs}, "
          f"{runner.num_scheduler_steps} scheduler steps per batch, KV cache {runner.kv_cache.dtype}, "
          f"prefix cache {'on' if prefix_caching else 'off'}", flush=True)  # fmt: skip

    # The floors of the batch-1 decode below: its context averages prompt + new/2 tokens.
    context = sizes.decode_prompt + sizes.decode_new // 2
    counted = decode_bytes(llm.model, context_len=context, batch=1, kv_dtype_bytes=engine_kv_bytes(llm))
    old, floor = DecodeFloor.old_and_honest(counted, read_bw, copy_bw)
    print(DecodeFloor.comparison_line(old, floor), flush=True)
    print(f"  honest bytes: {si(counted.streamed_weight_bytes, 'B')} weights (input embedding "
          f"{'tied: streamed by the head' if counted.embedding_tied else 'excluded'}, "
          f"{si(counted.embedding_bytes, 'B')}), {si(counted.kv_bytes, 'B')} KV at context {context}; "
          f"all weights {si(counted.all_weight_bytes, 'B')}", flush=True)  # fmt: skip
    results.add("floor", "old: all weights / copy bandwidth", label, old.describe(),
                ms=old.ms, bytes=old.bytes, bandwidth=old.bandwidth)  # fmt: skip
    results.add("floor", f"honest: bytes a batch-1 step reads (context {context}) / read bandwidth", label,
                floor.describe(), ms=floor.ms, bytes=floor.bytes,
                bandwidth=floor.bandwidth, weight_bytes=counted.streamed_weight_bytes, kv_bytes=counted.kv_bytes,
                all_weight_bytes=counted.all_weight_bytes, embedding_bytes=counted.embedding_bytes,
                embedding_tied=float(counted.embedding_tied))  # fmt: skip

    if "decode" in only:
        params = SamplingParams(max_tokens=sizes.decode_new, ignore_eos=True)
        llm.generate([prompt_decode], params)  # warm-up
        t = time.perf_counter()
        llm.generate([prompt_decode], params)
        ours_ms = (time.perf_counter() - t) * 1000 / sizes.decode_new
        itl = llm.metrics().inter_token_latency.mean * 1000  # gaps after each first token (both runs)
        pct = percent_of_floor(floor.ms, ours_ms)
        print(f"decode batch 1 ({sizes.decode_prompt}-token prompt, {sizes.decode_new} new): {ours_ms:.2f} ms/token "
              f"(prefill included; {itl:.2f} ms between tokens after the first); honest floor {floor.ms:.2f} ms: "
              f"{pct:.0f}% of the floor", flush=True)  # fmt: skip
        results.add("decode", f"batch 1, {sizes.decode_prompt}-token prompt, {sizes.decode_new} new (ms/token)",
                    label, f"{ours_ms:.2f} ms ({pct:.0f}% of the {floor.ms:.2f} ms floor)", ms_per_token=ours_ms,
                    percent_of_floor=pct, inter_token_ms=itl)  # fmt: skip
        results.add("decode", "same, between tokens after the first", label,
                    f"{itl:.2f} ms ({percent_of_floor(floor.ms, itl):.0f}% of the floor)", ms=itl,
                    percent_of_floor=percent_of_floor(floor.ms, itl))  # fmt: skip

    if "throughput" in only:
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in thr_outs]
        llm.generate(thr_prompts[:8], params[:8])  # warm-up
        t = time.perf_counter()
        res = llm.generate(thr_prompts, params)
        dt = time.perf_counter() - t
        n_out = sum(len(r.token_ids) for r in res)
        print(f"throughput ({len(thr_prompts)} prompts, in/out uniform {sizes.io_min}-{sizes.io_max}): "
              f"{n_out / dt:,.0f} output tok/s ({n_out} tokens in {dt:.1f} s)", flush=True)  # fmt: skip
        results.add("throughput", f"{len(thr_prompts)} prompts, in/out uniform {sizes.io_min}-{sizes.io_max}, "
                    f"max_num_seqs {args.max_num_seqs}, prefix cache {'on' if prefix_caching else 'off'}", label,
                    f"{n_out / dt:,.0f} output tok/s ({dt:.1f} s)",
                    tokens_per_s=n_out / dt, seconds=dt, output_tokens=n_out)  # fmt: skip

    if "prefix" in only:
        prefix_section(llm, sizes, device, rand_prompt, label, results)

    if "profile" in only:
        if device.type == "cuda":
            from engine_profile import profile

            figures = profile(llm, read_bw)
            for measure, (text, number) in figures.items():
                results.add("profile", measure, label, text, value=number)
        else:
            results.add("profile", "decode step GPU time", label, "skipped: needs CUDA graphs")

    if "rag-prefill" in only:
        if prefix_caching:  # this engine caches prefixes: rag-prefill gets one of its own without
            del llm, runner
            free_memory(device)
            llm = engine(folder, args, sizes, device, setting, prefix_caching=False)
            runner = llm.engine.model_runner
        rag_prefill(llm, sizes, args, rand_prompt, setting, peaks, results, device)

    del llm, runner
    free_memory(device)
    if device.type == "cuda":
        print(f"engine ({label}) freed: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated",
              flush=True)  # fmt: skip


def prefix_section(llm: LLM, sizes: Sizes, device: torch.device, rand_prompt: Callable[[int], list[int]], label: str,
                   results: Results) -> None:  # fmt: skip
    base = rand_prompt(sizes.prefix_cached)
    total = sizes.prefix_cached + sizes.prefix_tail

    def ttft(prompt: list[int]) -> float:
        sync(device)
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        sync(device)
        return time.perf_counter() - t

    colds, warms = [], []
    for _ in range(5):
        colds.append(ttft(rand_prompt(sizes.prefix_cached) + rand_prompt(sizes.prefix_tail)))  # never seen
        ttft(base + rand_prompt(sizes.prefix_tail))  # make sure `base` is cached
        warms.append(ttft(base + rand_prompt(sizes.prefix_tail)))
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"prefix cache: TTFT of a {total:,}-token prompt cold {cold * 1000:.1f} ms, with {sizes.prefix_cached:,} "
          f"tokens cached {warm * 1000:.1f} ms: {cold / warm:.1f}x faster", flush=True)  # fmt: skip
    print(f"prefix-cache counters: {llm.metrics()}")
    results.add("prefix", f"TTFT of a {total:,}-token prompt, {sizes.prefix_cached:,} cached vs cold", label,
                f"{warm * 1000:.1f} vs {cold * 1000:.1f} ms ({cold / warm:.1f}x)", warm_ms=warm * 1000,
                cold_ms=cold * 1000, speedup=cold / warm)  # fmt: skip


def rag_prefill(llm: LLM, sizes: Sizes, args: argparse.Namespace, rand_prompt: Callable[[int], list[int]],
                setting: Setting, peaks: dict[str, float], results: Results, device: torch.device) -> None:  # fmt: skip
    """RAG-shaped prefill: every prompt a few random sources and a question, all queued at once, one token out."""
    if llm.engine.block_manager.enable_prefix_caching:
        raise SystemExit("rag-prefill measures prefill without the prefix cache; run it without the prefix section")
    length = sizes.rag_prompt_len

    def prompt() -> list[int]:
        return [t for _ in range(sizes.rag_sources) for t in rand_prompt(sizes.rag_source_tokens)] + rand_prompt(
            sizes.rag_question
        )

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([prompt() for _ in range(4)], params)  # warm-up
    prompts = [prompt() for _ in range(args.rag_prompts)]
    sync(device)
    t = time.perf_counter()
    llm.generate(prompts, params)
    sync(device)
    dt = time.perf_counter() - t
    rate = len(prompts) * length / dt
    flops = prefill_flops(llm.model, length)
    achieved = len(prompts) * flops / dt
    peak_name = "fp8" if setting.quantization == "fp8" and "fp8" in peaks else "bf16"
    peak = peaks.get(peak_name)
    share = f", {achieved / peak * 100:.0f}% of the {peak_name} matmul peak" if peak else ""
    shape = f"{len(prompts)} prompts of {sizes.rag_sources} x {sizes.rag_source_tokens} + {sizes.rag_question} tokens"
    print(f"rag-prefill ({shape}, no prefix cache, all at once, max_tokens 1): {rate:,.0f} prompt tok/s "
          f"({dt:.2f} s), {si(flops / length, 'FLOP')} per token: {si(achieved, 'FLOP/s')}{share}",
          flush=True)  # fmt: skip
    results.add("rag-prefill", f"{shape}, no prefix cache, max_tokens 1", setting.label,
                f"{rate:,.0f} prompt tok/s, {si(achieved, 'FLOP/s')}{share}", tokens_per_s=rate,
                seconds=dt, flops_per_s=achieved, flops_per_prompt=flops,
                **({"share_of_peak": achieved / peak} if peak else {}))  # fmt: skip
    from generation.layers.kernel_choice import fp8_producer_quantize

    if device.type == "cuda" and setting.quantization == "fp8" and fp8_producer_quantize():
        # The peer of the fused quantization: the same prompts with each FP8 input quantized in a
        # launch of its own after its norm / SiLU-and-mul (the code before the fusion).
        from generation.layers.kernel_choice import set_fp8_producer_quantize

        set_fp8_producer_quantize(False)
        try:
            sync(device)
            t = time.perf_counter()
            llm.generate(prompts, params)
            sync(device)
            separate = len(prompts) * length / (time.perf_counter() - t)
        finally:
            set_fp8_producer_quantize(True)
        print(f"rag-prefill, FP8 inputs quantized in launches of their own: {separate:,.0f} prompt tok/s; "
              f"fused into the norms and SiLU-and-mul: {rate:,.0f} ({rate / separate:.2f}x)", flush=True)
        results.add("rag-prefill", "FP8 input quantization: separate launches vs fused", setting.label,
                    f"{separate:,.0f} vs {rate:,.0f} prompt tok/s ({rate / separate:.2f}x)",
                    separate_tokens_per_s=separate, fused_tokens_per_s=rate)  # fmt: skip
    if device.type == "cuda":
        # Where the prefill's GPU time goes (item 5 of issue 32 tunes what this shows), over a
        # sixth of the prompts, profiled on their own.
        from engine_profile import prefill_shares

        subset = prompts[: max(4, len(prompts) // 6)]
        rows = prefill_shares(lambda: llm.generate(subset, params))
        busy = sum(ms for _, ms, _ in rows)
        print(f"rag-prefill GPU time by part ({len(subset)} prompts, {busy:.1f} ms busy): " + ", ".join(
            f"{part} {ms:.1f} ms ({ms / busy * 100:.0f}%, {n} kernels)" for part, ms, n in rows), flush=True)
        results.add("rag-prefill", "GPU time by part (profiled subset)", setting.label, ", ".join(
            f"{part} {ms / busy * 100:.0f}%" for part, ms, _ in rows[:5]),
            **{f"share_{part.split()[0].lower()}": ms / busy for part, ms, _ in rows})  # fmt: skip


if __name__ == "__main__":
    main()
