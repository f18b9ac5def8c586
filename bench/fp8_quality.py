"""Quality of FP8 weights and FP8 KV against fp32/bf16, on the packaged SmolLM2 through our engine's own paths.

For each setting (fp32, bf16, FP8 weights, FP8 KV cache, both) on the same model:
  perplexity  teacher-forced over the sample lab documents (examples/lab-docs, text and Markdown),
              each document fed through the engine's paged prefill in chunks (--chunk tokens), so
              every chunk attends to the KV that earlier chunks stored in the cache (in e4m3 when
              the KV cache is FP8); NLL of every next token after the first.
  agreement   greedy answers (--max-tokens) to the sample questions (examples/questions.jsonl),
              each with its first relevant document as context, against the fp32 answers: the
              share of answers identical to fp32, and the mean share of each answer's tokens
              before its first difference.
On CPU the FP8 layers run the reference path (dequantize, fp32 matmul), so the figures are the
numerics of the format, which the GPU kernels are tested against.

    PYTHONPATH=. python bench/fp8_quality.py [--docs 26] [--questions 39] [--max-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import describe_machine  # noqa: E402

from generation import LLM, SamplingParams  # noqa: E402
from generation.layers.attention import AttentionMetadata  # noqa: E402

# name -> (dtype, quantization, kv_cache_dtype); the first row is the reference.
SETTINGS: dict[str, tuple[torch.dtype, str | None, str]] = {
    "fp32": (torch.float32, None, "auto"),
    "bf16": (torch.bfloat16, None, "auto"),
    "fp8 weights": (torch.float32, "fp8", "auto"),
    "fp8 KV": (torch.float32, None, "fp8"),
    "fp8 weights + KV": (torch.float32, "fp8", "fp8"),
}


@dataclass
class Row:
    setting: str
    perplexity: float
    tokens: int
    identical: float
    prefix_share: float
    seconds: float


def documents(limit: int) -> list[str]:
    """The sample lab documents that are plain text (Markdown, .txt), sorted by path."""
    files = sorted(p for p in (ROOT / "examples" / "lab-docs").rglob("*") if p.suffix in (".md", ".txt"))
    return [p.read_text(encoding="utf-8") for p in files[:limit]]


def questions(limit: int) -> list[tuple[str, str]]:
    """(question, context) pairs: each sample question with the text of its first relevant document."""
    out = []
    seen = set()
    for line in (ROOT / "examples" / "questions.jsonl").read_text().splitlines():
        item = json.loads(line)
        rel = [r for r in item.get("relevant", []) if r.endswith((".md", ".txt"))]
        if not rel or item["question"] in seen:
            continue
        seen.add(item["question"])
        out.append((item["question"], (ROOT / "examples" / "lab-docs" / rel[0]).read_text(encoding="utf-8")))
    return out[:limit]


@torch.inference_mode()
def paged_nll(llm: LLM, ids: list[int], chunk: int) -> tuple[float, int]:
    """Summed NLL of ids[1:] given their prefixes, fed through the paged prefill `chunk` tokens at a time.

    One sequence in blocks 0..n-1 of the engine's own KV cache (nothing else runs), so each chunk
    reads the KV of the chunks before it from the cache, in the cache's dtype.
    """
    runner = llm.engine.model_runner
    block = runner.block_size
    num_blocks = -(-len(ids) // block)
    assert num_blocks <= runner.num_kv_blocks, "document longer than the KV pool"
    table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids))
        n = end - start
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.arange(start, end, dtype=torch.int64),
            context_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table,
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        )
        hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, runner.kv_caches)
        logits = runner.model.compute_logits(hidden).float()
        targets = torch.tensor(ids[start + 1 : end + 1])
        logits = logits[: len(targets)]
        total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return total, count


def run_setting(model_dir: Path, name: str, docs: list[list[int]], prompts: list[list[int]], args) -> tuple:
    dtype, quant, kv = SETTINGS[name]
    llm = LLM(model_dir, device="cpu", dtype=dtype, quantization=quant, kv_cache_dtype=kv,
              num_kv_blocks=-(-args.max_len // 16) + 8, max_model_len=args.max_len, enable_prefix_caching=False)
    t = time.perf_counter()
    nll, n = 0.0, 0
    for ids in docs:
        a, b = paged_nll(llm, ids, args.chunk)
        nll, n = nll + a, n + b
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    answers = [list(r.token_ids) for r in llm.generate(prompts, params)] if prompts else []
    seconds = time.perf_counter() - t
    del llm
    gc.collect()
    return math.exp(nll / max(n, 1)), n, answers, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=26, help="how many sample documents (text and Markdown) to score")
    ap.add_argument("--questions", type=int, default=39, help="how many sample questions to answer")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy answer length")
    ap.add_argument("--max-len", type=int, default=1024, help="tokens per document and prompt (longer are cut)")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk while scoring")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: " + ", ".join(SETTINGS))
    ap.add_argument("--cache", default=None, help="model cache folder (the SmolLM2 conversion, once)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    from generation.loader import resolve_model_dir

    cache = Path(args.cache) if args.cache else Path(tempfile.gettempdir()) / "rag-bench-cache"
    model_dir = resolve_model_dir(None, cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    docs = [tok(d, add_special_tokens=False)["input_ids"][: args.max_len] for d in documents(args.docs)]
    docs = [d for d in docs if len(d) > 1]
    prompts = []
    for q, ctx in questions(args.questions):
        ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"][: args.max_len - 200]
        messages = [{"role": "system", "content": "Answer from the context."},
                    {"role": "user", "content": f"Context:\n{tok.decode(ctx_ids)}\n\nQuestion: {q}"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids)[: args.max_len - args.max_tokens])
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; valid: {', '.join(SETTINGS)}")
    if names[0] != "fp32":
        names = ["fp32", *[n for n in names if n != "fp32"]]  # the reference for agreement
    print(f"# FP8 quality, SmolLM2-135M ({model_dir.name}); {describe_machine(use_gpu=False)}; "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(f"# {len(docs)} documents ({sum(len(d) for d in docs)} tokens, chunks of {args.chunk}), "
          f"{len(prompts)} questions, {args.max_tokens} greedy tokens each")
    rows: list[Row] = []
    reference: list[list[int]] = []
    for name in names:
        ppl, n, answers, seconds = run_setting(model_dir, name, docs, prompts, args)
        if name == "fp32":
            reference = answers
        same = sum(a == r for a, r in zip(answers, reference, strict=True))
        shares = []
        for a, r in zip(answers, reference, strict=True):
            k = 0
            while k < min(len(a), len(r)) and a[k] == r[k]:
                k += 1
            shares.append(k / max(len(r), 1))
        rows.append(Row(name, ppl, n, same / max(len(answers), 1), sum(shares) / max(len(shares), 1), seconds))
        print(f"  {name}: perplexity {ppl:.3f} over {n} tokens, {seconds:.0f} s", flush=True)
    base = rows[0].perplexity
    print("\n| setting | perplexity | vs fp32 | answers identical to fp32 | tokens before the first difference |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.setting} | {r.perplexity:.3f} | {(r.perplexity / base - 1) * 100:+.2f}% | "
              f"{r.identical * 100:.0f}% | {r.prefix_share * 100:.0f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))


if __name__ == "__main__":
    main()
