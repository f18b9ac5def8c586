"""Benchmark the generation engine on a Llama-3.1-8B-shaped model (random bf16 weights).

Every figure is printed beside its peer measured in the same run:
  decode      batch-1 decode (512-token prompt, 256 new tokens): ms/token, ours vs Hugging Face
              `generate` vs the bandwidth floor (weight bytes / device-to-device copy bandwidth).
  throughput  N prompts, input and output lengths uniform in 100-1024 (ignore_eos): output
              tokens/s, ours vs HF `generate` in padded batches (HF on a subsample, rate compared).
  prefix      time to first token of a 4,096-token prompt, cold vs with its first 4,000 tokens
              cached; and the cost of the cache with no reuse (cache on vs off, distinct prompts).
  profile     GPU time of decode steps (graph replays) and of the eager short prefill, fused
              kernels on vs off (bench/engine_profile.py), beside the floor.

    PYTHONPATH=. python bench/engine_llama8b.py [--only decode,throughput,prefix,overhead,profile]
        [--prompts 1000] [--hf-prompts 32 | --skip-hf] [--folder DIR]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from generation import LLM, SamplingParams

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), best of several."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    best = 0.0
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = max(best, 2 * x.numel() / (time.perf_counter() - t))
    del x, y
    return best


def make_model(folder: Path) -> int:
    """Write random bf16 weights of the 8B shape; returns the weight bytes."""
    config = LlamaConfig(**LLAMA_8B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    for p in model.parameters():  # small weights keep activations finite
        torch.nn.init.normal_(p, std=0.02)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return n_bytes


def hf_generate_time(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for HF generate on one left-padded batch producing exactly new_tokens each."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="decode,throughput,prefix,overhead")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine concurrency (decode batch ceiling)")
    ap.add_argument("--hf-prompts", type=int, default=32, help="subsample for the HF throughput peer")
    ap.add_argument("--skip-hf", action="store_true", help="no Hugging Face peers (quick runs)")
    ap.add_argument("--folder", default=None, help="reuse a saved random model folder")
    ap.add_argument("--child-overhead", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    only = set(args.only.split(","))
    if args.child_overhead:
        return child_overhead(Path(args.folder), args.child_overhead)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    bw = copy_bandwidth()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="llama8b-"))
    if not (folder / "config.json").exists():
        weight_bytes = make_model(folder)
    else:
        weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    floor_ms = weight_bytes / bw * 1000
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.2f} GB; "
        f"bandwidth floor {floor_ms:.2f} ms/token"
    )
    rng = random.Random(0)
    vocab = LLAMA_8B["vocab_size"]

    def rand_prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if "overhead" in only:
        # No reuse at all: distinct prompts, cache on vs off, each engine in its own process.
        times = {}
        for flag in ("on", "off"):
            proc = subprocess.run(
                [sys.executable, __file__, "--child-overhead", flag, "--folder", str(folder)],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise SystemExit(f"overhead child ({flag}) failed:\n{proc.stderr[-3000:]}")
            times[flag] = float(proc.stdout.strip().splitlines()[-1])
        print(
            f"prefix cache with no reuse (200 distinct prompts, 64 new tokens): {times['on']:.2f} s on vs "
            f"{times['off']:.2f} s off ({(times['on'] / times['off'] - 1) * 100:+.1f}%)"
        )

    prompt512 = rand_prompt(512)
    thr_prompts = [rand_prompt(rng.randint(100, 1024)) for _ in range(args.prompts)]
    thr_outs = [rng.randint(100, 1024) for _ in range(args.prompts)]

    # Peers first: Hugging Face generate on the same weights (freed before our engine starts).
    hf_ms = hf_rate = None
    if only & {"decode", "throughput"} and not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
        hf.eval()
        if "decode" in only:
            hf_generate_time(hf, [prompt512], 8)
            hf_ms = hf_generate_time(hf, [prompt512], 256) * 1000 / 256
        if "throughput" in only:
            sub = list(range(min(args.hf_prompts, len(thr_prompts))))
            n_out, t_total = 0, 0.0
            for start in range(0, len(sub), 32):  # padded batches of 32, each run to its longest output
                idx = sub[start : start + 32]
                t_total += hf_generate_time(hf, [thr_prompts[i] for i in idx], max(thr_outs[i] for i in idx))
                n_out += sum(thr_outs[i] for i in idx)  # useful tokens only
            hf_rate = n_out / t_total
        del hf
        gc.collect()
        torch.cuda.empty_cache()

    llm = LLM(folder, device="cuda", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=4608)
    steps = llm.engine.model_runner.num_scheduler_steps
    print(f"engine: max_num_seqs {args.max_num_seqs}, {steps} scheduler steps per batch")
    if "decode" in only:
        params = SamplingParams(max_tokens=256, ignore_eos=True)
        llm.generate([prompt512], params)  # warm-up
        t = time.perf_counter()
        llm.generate([prompt512], params)
        ours_ms = (time.perf_counter() - t) * 1000 / 256
        itl = llm.metrics().inter_token_latency.mean * 1000  # gaps after each first token (both runs)
        hf = f"HF generate {hf_ms:.2f} ms/token ({hf_ms / ours_ms:.1f}x faster)" if hf_ms else "HF skipped"
        print(
            f"decode batch 1 (512-token prompt, 256 new): ours {ours_ms:.2f} ms/token (prefill included; "
            f"{itl:.2f} ms between tokens after the first), {hf}, bandwidth floor {floor_ms:.2f} ms "
            f"(ours reaches {floor_ms / ours_ms * 100:.0f}% of the floor)"
        )
    if "throughput" in only:
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in thr_outs]
        llm.generate(thr_prompts[:8], params[:8])  # warm-up
        t = time.perf_counter()
        res = llm.generate(thr_prompts, params)
        dt = time.perf_counter() - t
        n_out = sum(len(r.token_ids) for r in res)
        hf = (
            f"HF generate in batches of 32 ({args.hf_prompts}-prompt subsample) {hf_rate:,.0f} tok/s; "
            f"ours {n_out / dt / hf_rate:.1f}x"
            if hf_rate
            else "HF skipped"
        )
        print(
            f"throughput ({args.prompts} prompts, in/out uniform 100-1024): ours {n_out / dt:,.0f} output tok/s "
            f"({n_out} tokens in {dt:.1f} s); {hf}"
        )
    if "prefix" in only:
        base = rand_prompt(4000)

        def ttft(prompt: list[int], engine: LLM = llm) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            return time.perf_counter() - t

        colds, warms = [], []
        for _ in range(5):
            colds.append(ttft(rand_prompt(4000) + rand_prompt(96)))  # a prefix never seen
            ttft(base + rand_prompt(96))  # make sure `base` is cached
            warms.append(ttft(base + rand_prompt(96)))
        cold, warm = statistics.median(colds), statistics.median(warms)
        print(
            f"prefix cache: TTFT of a 4,096-token prompt cold {cold * 1000:.1f} ms, with 4,000 tokens "
            f"cached {warm * 1000:.1f} ms: {cold / warm:.1f}x faster"
        )
        print(f"prefix-cache counters: {llm.metrics()}")
    if "profile" in only:
        from engine_profile import profile

        profile(llm, floor_ms)


def child_overhead(folder: Path, flag: str) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 128000) for _ in range(rng.randint(100, 1024))] for _ in range(200)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    e = LLM(folder, device="cuda", enable_prefix_caching=flag == "on", max_model_len=4608)
    e.generate([[5] * 64] * 4, params)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        e.generate(prompts, params)
        best = min(best, time.perf_counter() - t)
        if flag == "on":  # so the second pass cannot reuse the first pass's blocks
            e.engine.block_manager.reset_prefix_cache()
    print(best)


if __name__ == "__main__":
    main()
