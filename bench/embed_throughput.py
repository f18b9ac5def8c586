"""Benchmark: our Embedder vs sentence-transformers `encode`, same model folder, same run.

Throughput in chunks/s and tokens/s, tokenization included, for each model folder given and two
chunk-length distributions: the lengths of the chunks `rag ingest examples/lab-docs` makes
(CORPUS_LENGTHS, MiniLM tokens with [CLS]/[SEP]) and uniform 64-512 tokens. Texts are random
vocabulary words, one token each, so every text has exactly its drawn length. Both sides get the
same dtype, batch_size, max_length and GPU; on several GPUs our embedder is also run on all of
them (one process each). Prints the hardware, the date and the ratios.

    PYTHONPATH=. python bench/embed_throughput.py --prepare .benchmodels    # here, once (CPU)
    PYTHONPATH=. python bench/embed_throughput.py --models .benchmodels/minilm,.benchmodels/bge-base-shape
        [--device cuda|cpu] [--n-corpus 32768] [--n-uniform 16384] [--budget-scale 4] [--old OLD_embed.py]

A folder with config.json and tokenizer files but no weights gets random weights first (fine for
speed); a folder that sentence-transformers should load needs modules.json and 1_Pooling/.
On two H200s the full run takes about 5 minutes, most of it in sentence-transformers.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ingest.embed.embedder import Embedder, EmbedderConfig

# Token counts (with [CLS] and [SEP]) of the 140 chunks `rag ingest examples/lab-docs` made
# (chunk_max_tokens 200, overlap 32), in catalog order: a fixed corpus, recorded when this
# benchmark was added (commit ad49eac), not re-measured per run.
CORPUS_LENGTHS = [
    34, 184, 168, 93, 55, 43, 133, 68, 61, 47, 128, 95, 119, 100, 84, 85, 72, 120, 92, 62,
    48, 46, 172, 141, 50, 74, 95, 116, 78, 73, 104, 110, 116, 161, 137, 54, 79, 89, 164, 58,
    43, 78, 55, 80, 126, 170, 142, 72, 142, 66, 85, 52, 195, 191, 103, 125, 198, 111, 144, 93,
    95, 98, 75, 84, 46, 95, 179, 66, 48, 89, 97, 98, 95, 70, 95, 64, 60, 153, 30, 81,
    35, 44, 98, 88, 96, 67, 71, 46, 95, 76, 171, 134, 126, 197, 76, 88, 43, 74, 49, 61,
    126, 118, 65, 66, 81, 116, 79, 173, 71, 53, 109, 126, 105, 91, 88, 54, 69, 92, 68, 65,
    41, 47, 82, 77, 71, 64, 67, 45, 70, 179, 52, 36, 61, 82, 69, 142, 48, 158, 202, 120,
]


def word_pool(tokenizer) -> list[str]:
    """Lower-case vocabulary words that the tokenizer keeps as one token each."""
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3)
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    return [w for w, i in zip(words, ids, strict=True) if len(i) == 1]


def make_texts(tokenizer, lengths: np.ndarray, seed: int) -> list[str]:
    """One text per length, exactly that many tokens with the special tokens (when no truncation)."""
    rng = np.random.default_rng(seed)
    pool = np.array(word_pool(tokenizer))
    special = len(tokenizer("")["input_ids"])
    return [" ".join(rng.choice(pool, size=max(1, int(n) - special))) for n in lengths]


def ensure_weights(folder: Path) -> None:
    """Give a folder that has only config.json random weights (seeded, saved as safetensors)."""
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} has no config.json: give model folders (config.json, tokenizer files)")
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        return
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(folder)
    print(f"  (random weights written to {folder})", flush=True)


def prepare_folders(out: Path) -> None:
    """Write the two model folders the GPU run uses, small enough to travel (about 46 MB).

    out/minilm: the packaged all-MiniLM-L6-v2 with its weights cast to fp16 (45 MB instead of 90).
    out/bge-base-shape: its tokenizer (bge-base uses the same BERT uncased vocabulary), a BERT-base
    config.json (12 layers, hidden 768, 12 heads, intermediate 3072) and CLS pooling; random
    weights are written at first use.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ingest.embed.embedder import default_embedder_path

    src = default_embedder_path()
    files = ["config_sentence_transformers.json", "modules.json", "special_tokens_map.json", "tokenizer.json",
             "tokenizer_config.json", "vocab.txt"]
    for name, extra in (("minilm", ["config.json", "sentence_bert_config.json", "1_Pooling/config.json"]),
                        ("bge-base-shape", [])):
        (out / name / "1_Pooling").mkdir(parents=True, exist_ok=True)
        for f in files + extra:
            shutil.copy(src / f, out / name / f)
    weights = load_file(src / "model.safetensors")
    save_file({k: v.half().contiguous() for k, v in weights.items()}, out / "minilm" / "model.safetensors",
              metadata={"format": "pt"})
    bge = out / "bge-base-shape"
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    (bge / "config.json").write_text(json.dumps(config, indent=2))
    (bge / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": True}))
    (bge / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 768, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    print(f"wrote {out / 'minilm'} and {bge}")


def load_old_embedder(path: str) -> type:
    spec = importlib.util.spec_from_file_location("embed_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["embed_old"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(fn: Callable[[list[str]], np.ndarray], texts: list[str], device: str) -> tuple[float, np.ndarray]:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(texts)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def hardware(device: str) -> str:
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpu = f"{len(names)} x {names[0]}"
    else:
        gpu = "no GPU"
    return (f"{gpu}; {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}); "
            f"torch {torch.__version__}, threads {torch.get_num_threads()}")


def build_runs(folder: Path, args: argparse.Namespace, num_gpus: int) -> tuple[Embedder, dict]:
    """Our embedder (and its peers) on one model folder, each as texts -> vectors."""
    base = dict(model=folder, batch_size=args.batch_size, max_length=args.max_length)
    first = "cuda:0" if args.device == "cuda" else "cpu"
    ours = Embedder(EmbedderConfig(device=first, devices=(first,), **base))
    runs: dict[str, Callable[[list[str]], np.ndarray]] = {"ours": ours.embed}
    if num_gpus > 1:
        runs[f"ours x{num_gpus} GPUs"] = Embedder(EmbedderConfig(**base)).embed
    if args.budget_scale > 1:  # the same, with a bigger token budget per forward pass
        budget = args.budget_scale * args.batch_size * args.max_length
        runs[f"ours, budget x{args.budget_scale}"] = Embedder(
            EmbedderConfig(device=first, devices=(first,), max_batch_tokens=budget, **base)).embed
    if args.old:
        old = load_old_embedder(args.old)
        runs["old embedder"] = old.Embedder(old.EmbedderConfig(device=first, **base)).embed
    if not args.no_st:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(folder), device=first,
                                 model_kwargs={"dtype": getattr(torch, ours.dtype), "attn_implementation": "sdpa"})
        st.max_seq_length = ours.max_length
        runs["sentence-transformers"] = lambda t: st.encode(
            t, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
    return ours, runs


def bench_model(folder: Path, args: argparse.Namespace, num_gpus: int) -> list[tuple]:
    """Time every run on both length distributions; returns summary rows."""
    ensure_weights(folder)
    ours, runs = build_runs(folder, args, num_gpus)
    print(f"\n{folder.name}: {ours.model.config.num_hidden_layers} layers, hidden {ours.dim}, "
          f"pooling {ours.pooling}, {ours.dtype}, batch_size {args.batch_size}, max_length {ours.max_length}, "
          f"our token budget {ours.max_batch_tokens}, ready 4D mask {ours.runner.uses_prepared_mask}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for dist in args.dists.split(","):
        if dist == "corpus":
            lengths = rng.choice(np.array(CORPUS_LENGTHS), size=args.n_corpus)
        else:
            lengths = rng.integers(64, 513, size=args.n_uniform)
        texts = make_texts(ours.tokenizer, lengths, seed=1)
        t = time.perf_counter()
        window = ours.runner.encoder.encode(texts)
        t_tok = time.perf_counter() - t
        assert (window.lengths == np.minimum(lengths, ours.max_length)).all(), "texts miss their drawn lengths"
        tokens = int(window.lengths.sum())
        for fn in runs.values():  # warm-up: CUDA init, kernels, worker processes
            fn(texts[: args.warmup])
        best: dict[str, float] = {}
        vectors: dict[str, np.ndarray] = {}
        names = list(runs)
        for rep in range(args.reps):
            # A different one goes first each time, so drift in a shared machine's load hits all alike.
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                dt, vectors[name] = timed(runs[name], texts, args.device)
                best[name] = min(best.get(name, float("inf")), dt)
        print(f"  {dist}: {len(texts)} chunks, {tokens} tokens (mean {tokens / len(texts):.0f}); "
              f"our tokenizer alone {tokens / t_tok / 1e6:.2f} M tok/s", flush=True)
        peer = best.get("sentence-transformers") or best.get("old embedder")
        for name, dt in best.items():
            cos = float((vectors[name] * vectors["ours"]).sum(1).min())
            ratio = f"{peer / dt:5.2f}x" if peer else "  -  "
            print(f"    {name:22s} {dt:7.3f} s  {len(texts) / dt:9.0f} chunks/s  {tokens / dt / 1e6:6.2f} M tok/s"
                  f"  vs peer {ratio}  min cos to ours {cos:.5f}", flush=True)
            rows.append((folder.name, dist, name, len(texts) / dt, tokens / dt, peer / dt if peer else None))
    for fn in runs.values():
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, Embedder):
            owner.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated model folders")
    ap.add_argument("--prepare", help="write the minilm and bge-base-shape folders here, then exit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dists", default="corpus,uniform")
    ap.add_argument("--n-corpus", type=int, default=32768)
    ap.add_argument("--n-uniform", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2048, help="texts embedded once by each before timing")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each; the best is reported")
    ap.add_argument("--budget-scale", type=int, default=1, help="also run ours with this times the token budget")
    ap.add_argument("--old", help="path to an older ingest/embed/embedder.py to measure too")
    ap.add_argument("--no-st", action="store_true", help="skip sentence-transformers")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.prepare:
        prepare_folders(Path(args.prepare))
        return
    if not args.models:
        ap.error("--models is required (or --prepare)")

    import transformers

    st_version = "absent"
    if not args.no_st:
        try:
            import sentence_transformers

            st_version = sentence_transformers.__version__
        except ImportError:
            args.no_st = True
    run_date = datetime.date.today()  # the date of this run, printed with its figures
    print(f"embed throughput, {run_date}; {hardware(args.device)}; "
          f"transformers {transformers.__version__}, sentence-transformers {st_version}", flush=True)
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    summary = []
    for folder in args.models.split(","):
        try:
            summary += bench_model(Path(folder), args, num_gpus)
        except Exception:  # one broken model must not cost the other's figures
            traceback.print_exc()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\nsummary ({run_date}; {hardware(args.device)}): ratio = peer time / this time "
          "(peer: sentence-transformers, else the old embedder)")
    for model, dist, name, cps, tps, ratio in summary:
        r = f"{ratio:.2f}x" if ratio else "-"
        print(f"  {model:24s} {dist:8s} {name:22s} {cps:9.0f} chunks/s {tps / 1e6:6.2f} M tok/s  {r}")


if __name__ == "__main__":
    main()
