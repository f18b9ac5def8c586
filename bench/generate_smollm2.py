"""Benchmark: our generator vs Hugging Face `generate` on the packaged SmolLM2-135M.

Same model folder, same prompt, greedy, fixed output length (ignore_eos), both measured in
this run. Prints ms per output token for batch 1 and output tokens/s for a batch, the ratio
ours/HF, the hardware and the date. Runs on CPU (here) or CUDA (the device machine):

    PYTHONPATH=. python bench/generate_smollm2.py [--device cpu|cuda] [--new-tokens 64]

Exits non-zero, before timing anything, if our greedy tokens differ from HF's (a different
length included), and after timing if a timed run of ours produced fewer tokens than asked: a
faster engine that stops early is not a result.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from generation import LLM, SamplingParams
from generation.loader import resolve_model_dir

PROMPT = ("Sources:\n\n[1] Cluster guide\nAll GPU work goes through the gpu partition, which "
          "contains the eight nodes gpu01-gpu08. A single job may use at most 4 GPUs.\n\n"
          "Question: Which GPU nodes can I use?")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=os.environ.get("RAG_HOME", ".rag") + "/models")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    model_dir = resolve_model_dir(None, Path(args.cache) if args.cache else Path(tempfile.mkdtemp()))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ours = LLM(model_dir, device=args.device, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    ids = ours.apply_chat_template([{"role": "user", "content": PROMPT}])
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def ours_run(batch: int):
        def run():
            outs = ours.generate([ids] * batch, params)
            short = [len(o.token_ids) for o in outs if len(o.token_ids) != n]
            if short:
                sys.exit(
                    f"FAIL: our engine produced {short[0]} tokens instead of the {n} asked for "
                    f"({len(short)} of {batch} requests); the timing would count "
                    "tokens that were never generated"
                )
        return run

    def hf_run(batch: int):
        x = torch.tensor([ids] * batch, device=args.device)

        def run():
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)
        return run

    # Same greedy tokens, or the comparison means nothing. (Checked with EOS allowed: HF's
    # min_new_tokens, used below for fixed lengths, bans EOS and so changes the greedy path.)
    with torch.inference_mode():
        x = torch.tensor([ids], device=args.device)
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()
    mine = ours.generate([ids], SamplingParams(max_tokens=n))[0].token_ids
    # Exactly equal, length included: both stop at the same EOS or both run to n tokens. A
    # shorter output of ours is a failure, not a prefix match.
    if mine != ref:
        first = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), min(len(mine), len(ref)))
        sys.exit(
            f"FAIL: greedy tokens differ from HF's: ours has {len(mine)} tokens, HF {len(ref)} "
            f"(of {n} asked for), first difference at token {first}; not timing an engine that "
            "does not generate the same text"
        )
    ended = "both ended at EOS" if len(ref) < n else "no EOS"

    hw = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"SmolLM2-135M-Instruct, prompt {len(ids)} tokens, {n} new tokens, {args.device} ({hw}), "
          f"{datetime.date.today()}; greedy tokens identical to HF ({len(ref)} of {n}, {ended})")
    for batch in (1, args.batch):
        t_ours = _time(ours_run(batch), args.device, args.repeats)
        t_hf = _time(hf_run(batch), args.device, args.repeats)
        print(f"batch {batch:3d}: ours {1000 * t_ours / n:7.2f} ms/step {batch * n / t_ours:8.1f} tok/s | "
              f"HF generate {1000 * t_hf / n:7.2f} ms/step {batch * n / t_hf:8.1f} tok/s | "
              f"ours/HF throughput {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
