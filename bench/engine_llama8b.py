"""Benchmark the generation engine on a Llama-3.1-8B-shaped model (random bf16 weights).

Every figure is printed beside its peer measured in the same run:
  decode      batch-1 decode (512-token prompt, 256 new tokens): ms/token, ours vs Hugging Face
              `generate` vs the bandwidth floor (weight bytes / device-to-device copy bandwidth).
  throughput  N prompts, input and output lengths uniform in 100-1024 (ignore_eos): output
              tokens/s, ours vs HF `generate` in padded batches (HF on a subsample, rate compared).
  prefix      time to first token of a 4,096-token prompt, cold vs with its first 4,000 tokens
              cached; and the cost of the cache with no reuse (cache on vs off, distinct prompts).

    PYTHONPATH=. python bench/engine_llama8b.py [--only decode,throughput,prefix] [--prompts 1000]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from generation import LLM, SamplingParams

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                tie_word_embeddings=False, torch_dtype="bfloat16")


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
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="decode,throughput,prefix")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--hf-prompts", type=int, default=64, help="subsample for the HF throughput peer")
    ap.add_argument("--folder", default=None, help="reuse a saved random model folder")
    args = ap.parse_args()
    only = set(args.only.split(","))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    bw = copy_bandwidth()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="llama8b-"))
    if not (folder / "config.json").exists():
        weight_bytes = make_model(folder)
    else:
        weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    floor_ms = weight_bytes / bw * 1000
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.2f} GB; "
          f"bandwidth floor {floor_ms:.2f} ms/token")
    rng = random.Random(0)
    vocab = LLAMA_8B["vocab_size"]

    def rand_prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    results: dict[str, float] = {}
    llm = LLM(folder, device="cuda", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4608)
    if "decode" in only:
        prompt = rand_prompt(512)
        params = SamplingParams(max_tokens=256, ignore_eos=True)
        llm.generate([prompt], params)  # warm-up
        t = time.perf_counter()
        llm.generate([prompt], params)
        ours_ms = (time.perf_counter() - t) * 1000 / 256
        results["decode_ms"] = ours_ms
    if "throughput" in only:
        prompts = [rand_prompt(rng.randint(100, 1024)) for _ in range(args.prompts)]
        outs = [rng.randint(100, 1024) for _ in range(args.prompts)]
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
        llm.generate(prompts[:8], params[:8])  # warm-up
        t = time.perf_counter()
        res = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        n_out = sum(len(r.token_ids) for r in res)
        results["throughput"] = n_out / dt
        print(f"throughput: ours {n_out} output tokens in {dt:.1f} s = {n_out / dt:,.0f} tok/s "
              f"({args.prompts} prompts)")
        throughput_set = (prompts, outs)
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
            fresh = rand_prompt(4000)  # a prefix never seen: cold
            colds.append(ttft(fresh + rand_prompt(96)))
            ttft(base + rand_prompt(96))  # make sure `base` is cached
            warms.append(ttft(base + rand_prompt(96)))
        cold, warm = statistics.median(colds), statistics.median(warms)
        results["ttft_cold_ms"], results["ttft_warm_ms"] = cold * 1000, warm * 1000
        print(f"prefix cache: TTFT of a 4,096-token prompt cold {cold * 1000:.1f} ms, with 4,000 tokens "
              f"cached {warm * 1000:.1f} ms: {cold / warm:.1f}x faster")
    hit_rate = llm.metrics().prefix_cache_hit_rate if hasattr(llm, "metrics") else float("nan")
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    if "prefix" in only:
        # No reuse at all: distinct prompts through an engine with the cache on and off.
        prompts = [rand_prompt(rng.randint(100, 1024)) for _ in range(200)]
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        times = {}
        for enabled in (True, False):
            e = LLM(folder, device="cuda", enable_prefix_caching=enabled, max_model_len=4608)
            e.generate(prompts[:4], params)
            t = time.perf_counter()
            e.generate(prompts[4:], params)
            times[enabled] = time.perf_counter() - t
            del e
            gc.collect()
            torch.cuda.empty_cache()
        print(f"prefix cache with no reuse: {times[True]:.2f} s on vs {times[False]:.2f} s off "
              f"({(times[True] / times[False] - 1) * 100:+.1f}%)")

    if only & {"decode", "throughput"}:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
        hf.eval()
        if "decode" in only:
            prompt = rand_prompt(512)
            hf_generate_time(hf, [prompt], 8)
            hf_ms = hf_generate_time(hf, [prompt], 256) * 1000 / 256
            ours_ms = results["decode_ms"]
            print(f"decode batch 1: ours {ours_ms:.2f} ms/token, HF generate {hf_ms:.2f} ms/token "
                  f"({hf_ms / ours_ms:.1f}x faster), bandwidth floor {floor_ms:.2f} ms "
                  f"(ours at {floor_ms / ours_ms * 100:.0f}% of the floor)")
        if "throughput" in only:
            prompts, outs = throughput_set
            sub = list(range(min(args.hf_prompts, len(prompts))))
            n_out = 0
            t_total = 0.0
            for start in range(0, len(sub), 32):  # HF in padded batches of 32, each to its longest output
                idx = sub[start:start + 32]
                new = max(outs[i] for i in idx)
                t_total += hf_generate_time(hf, [prompts[i] for i in idx], new)
                n_out += sum(outs[i] for i in idx)  # useful tokens only
            hf_rate = n_out / t_total
            print(f"throughput: HF generate (batches of 32, {len(sub)}-prompt subsample) {hf_rate:,.0f} useful "
                  f"tok/s; ours {results['throughput'] / hf_rate:.1f}x")
    print(f"prefix-cache hit rate over the run: {hit_rate:.3f}")


if __name__ == "__main__":
    main()
