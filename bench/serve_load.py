"""Benchmark the query service under load: `rag serve`'s app over HTTP, concurrent chat users.

The server (`bench/serve_load_server.py`: create_app under uvicorn, in its own process) answers
POST /v1/chat/completions with streaming, retrieving 5 sources per question from a synthetic
collection and generating a fixed number of tokens on the local engine (Llama-3.1-8B shape,
random bf16 weights). N users each send questions back to back; per concurrency level:

  server      p50/p99 time to first token (request sent -> first content delta) and output
              tok/s (completion_tokens from `usage` / wall time of the level);
  serialized  the same server with max_concurrent_generations=1 (one answer at a time), after the
              same warm-up, fewer requests per level (throughput taken to the K-th completed answer);
  offline     the engine alone (LLMEngine, same config and KV size) over the same prompt token
              ids, the same number in flight (ignore_eos), in this process after the servers stop.

The corpus: chunks of exactly `--source-tokens` words `wN` (the bench writes a WordLevel tokenizer
into the model folder, one token per word), each carrying a tag word found nowhere else; a
question names 5 tags (chunks drawn by Zipf popularity), so keyword retrieval returns exactly those
5 sources. Sources overlap across requests; the prefix-cache hit rate is read from the engine.

Users start staggered over one lone answer's latency (--no-stagger: together; with fixed output
lengths they then stay in lockstep); after the sweep the main server also runs 8 users started
together and a few non-streaming answers for its own timings. On the GPU machine,
which has no fastapi/uvicorn/pydantic, install wheels carried in bench/wheels/ (docs/benchmarks.md).

    PYTHONPATH=. python bench/serve_load.py [--concurrency 1,8,32,64] [--output-tokens 128]
        [--phases server,serialized,offline] [--folder DIR] [--out result.json]
    PYTHONPATH=. python bench/serve_load.py --tiny      # 2-layer model on the CPU, end to end
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings: sse

from sse import sse_events  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FILLER_WORDS = 100_000  # chunk text draws from w0..w99999
TAG_BASE = 100_000  # chunk i carries the tag word w{TAG_BASE + i}, in no other chunk
COLLECTION = "bench"
GOAL_SERIALIZED_X, GOAL_OFFLINE_SHARE, GOAL_TTFT_MS = 20.0, 0.70, 150.0


# -- model folder -------------------------------------------------------------------------------

def write_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """A WordLevel tokenizer of exactly `vocab_size` entries: words w0.. then the special tokens.

    Whitespace pre-tokenizer, so a text of N words `wN` is N tokens; anything else (English
    words of the prompt template, punctuation) is one [UNK] per word or punctuation run. No
    '.', '!', '?' or newline token exists, so generated text never looks like repeated sentences.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    n_words = vocab_size - len(SPECIALS)
    vocab = {f"w{i}": i for i in range(n_words)}
    special_ids = {s: n_words + j for j, s in enumerate(SPECIALS)}
    vocab.update(special_ids)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
        "unk_token": "[UNK]", "pad_token": "<|eos|>", "chat_template": CHATML, "model_max_length": 8192,
        "clean_up_tokenization_spaces": False}, indent=1))
    # The model's own EOS ids must be the tokenizer's (LlamaConfig defaults to id 2, here "w2").
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.update(bos_token_id=special_ids["<|bos|>"], eos_token_id=special_ids["<|im_end|>"])
            path.write_text(json.dumps(data, indent=1))
    return special_ids


def make_tiny_model(folder: Path, vocab_size: int) -> int:
    """A 2-layer random Llama with the 8B's vocabulary, fp32 on the CPU; returns the weight bytes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prepare_model(args) -> tuple[Path, int, str]:
    """The model folder (made unless --folder has one), its weight bytes and a one-line description."""
    folder = Path(args.folder or tempfile.mkdtemp(prefix="serve-load-model-"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        vocab = 128256
        if not (folder / "config.json").exists():
            make_tiny_model(folder, vocab)
        what = "tiny 2-layer Llama (hidden 64), random fp32 weights"
    else:
        from engine_llama8b import LLAMA_8B, make_model

        vocab = LLAMA_8B["vocab_size"]
        if not (folder / "config.json").exists():
            make_model(folder)
        what = "Llama-3.1-8B shape, random bf16 weights"
    write_tokenizer(folder, vocab)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return folder, weight_bytes, what


# -- corpus, users, workload --------------------------------------------------------------------

def write_settings(home: Path, args, folder: Path) -> None:
    lines = {
        "collection": COLLECTION, "generator": str(folder), "device": args.device, "store": "memory",
        "mode": "keyword", "rerank": False, "top_k": 5, "candidates": 5,
        "context_tokens": 5 * (args.source_tokens + 64), "max_new_tokens": args.output_tokens,
        "temperature": 0.0, "request_timeout": 900.0, "max_queued_generations": 1024,
        "answer_mode": "generate",  # a generated answer even from --tiny's model ("auto" quotes below 1B)
    }
    # bench/goodput.py calls this too, with its own settings for the engine's dtypes.
    if getattr(args, "quantization", "none") != "none":
        lines["engine_quantization"] = args.quantization
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        lines["engine_kv_cache_dtype"] = args.kv_cache_dtype
    home.mkdir(parents=True, exist_ok=True)
    (home / "rag.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in lines.items()))


def build_corpus(home: Path, n_chunks: int, source_tokens: int, n_users: int, seed: int) -> list[str]:
    """A public collection of one-chunk documents with random vectors; returns one API key per user."""
    from rag.pipeline import Rag
    from rag.settings import load_settings
    from rag.types import Chunk, Document

    assert n_chunks <= 128256 - len(SPECIALS) - TAG_BASE, "too many chunks for the tag words"
    rng = np.random.default_rng(seed)
    rag = Rag(load_settings(home=home))
    try:
        dim = 8
        rag.catalog.create_collection(COLLECTION, "bench-random-vectors", f"bench-random-vectors-{dim}", dim,
                                      {"max_tokens": source_tokens, "overlap_tokens": 0})
        index = rag.collection(COLLECTION)
        key_order = rng.permutation(n_chunks)  # document keys (the prompt's canonical order) vs popularity
        acl = frozenset({"public"})
        for i in range(n_chunks):
            words = rng.integers(0, FILLER_WORDS, source_tokens - 1)
            text = " ".join([f"w{TAG_BASE + i}", *(f"w{w}" for w in words)])
            key = f"/bench/doc{int(key_order[i]):05d}.txt"
            doc = Document(key=key, source=key, text=text, content_hash=f"h{i}", acl=acl)
            chunk = Chunk(document_key=key, index=0, text=text, num_tokens=source_tokens)
            index.replace_document(doc, acl, [chunk], rng.standard_normal((1, dim)).astype(np.float32))
        # Admin keys: the benchmark reads the per-stage timings_ms, which only admins get.
        return [rag.identity.create_key(f"bench{u}", label="serve_load", admin=True) for u in range(n_users)]
    finally:
        rag.close()


@dataclasses.dataclass
class Item:
    """One question of the workload: which user asks it and which 5 chunks it names."""

    index: int
    user: int
    chunks: list[int]

    @property
    def question(self) -> str:
        return "What about " + " ".join(f"w{TAG_BASE + c}" for c in self.chunks) + "?"


def make_items(rng: np.random.Generator, count: int, n_users: int, n_chunks: int, zipf: float,
               start: int = 0) -> list[Item]:
    """`count` questions; chunk i is picked with probability ~ 1/(i+1)^zipf (0: uniform), 5 distinct."""
    weights = 1.0 / np.arange(1, n_chunks + 1) ** zipf
    p = weights / weights.sum()
    return [Item(start + j, (start + j) % n_users, [int(c) for c in rng.choice(n_chunks, 5, replace=False, p=p)])
            for j in range(count)]


def prompt_ids_for(home: Path, folder: Path, keys: list[str], items: list[Item]) -> dict[int, tuple]:
    """Each item's prompt token ids and cache-namespace regions, built the way the server builds them.

    Rag.prepare (keyword retrieval, canonical order, packing) then LocalGenerator.prompt (chat
    template, tokenizer, segment regions), with an engine stand-in that holds only the tokenizer.
    """
    from generation.config import EngineConfig
    from generation.engine.llm_engine import load_tokenizer
    from rag.generators.local import LocalGenerator
    from rag.pipeline import Rag
    from rag.settings import load_settings

    rag = Rag(load_settings(home=home))
    try:
        tokenizer = load_tokenizer(folder)
        # The server's engine config is the default one (write_settings sets no engine option). An
        # empty prefix cache: the sources in the order a cold server gives them (the server itself
        # orders them by what its cache holds, which changes lengths by nothing).
        stand_in = SimpleNamespace(engine=SimpleNamespace(
            tokenizer=tokenizer, model_dir=folder, config=EngineConfig(),
            num_cached_prefix_tokens=lambda token_ids, namespace=None: 0))
        generator = LocalGenerator(engine=stand_in)
        rag.__dict__["generator"] = generator  # the cached_property's slot: no engine is loaded
        principals = [rag.identity.authenticate(k) for k in keys]
        out = {}
        for item in items:
            prepared = rag.prepare(item.question, principals[item.user], COLLECTION)
            assert prepared.request is not None and len(prepared.answer.citations) == 5, (
                f"question {item.index} retrieved {len(prepared.answer.citations)} sources, expected 5")
            out[item.index] = generator.prompt(prepared.request)
        return out
    finally:
        rag.__dict__.pop("generator", None)  # nothing to shut down
        rag.close()


# -- the server process -------------------------------------------------------------------------

class Server:
    """bench/serve_load_server.py in a subprocess, its log in the data directory."""

    def __init__(self, home: Path, port: int, env: dict[str, str], label: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = home / f"server-{label}.log"
        full_env = {**os.environ, **env, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "serve_load_server.py"), "--home", str(home), "--port", str(port)],
            env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    async def wait_ready(self, client, timeout: float) -> float:
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                r = await client.get(self.base + "/readyz", timeout=2.0)
                if r.status_code == 200 and r.json().get("generator") != "not loaded":
                    return time.perf_counter() - t
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            await asyncio.sleep(0.5)
        raise SystemExit(f"the server was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    async def metrics(self, client) -> dict:
        r = await client.get(self.base + "/bench/metrics", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- the load generator -------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    index: int
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


async def chat_request(client, base: str, key: str, item: Item, max_tokens: int) -> Result:
    body = {"model": COLLECTION, "messages": [{"role": "user", "content": item.question}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0.0}
    t = time.perf_counter()
    res = Result(item.index, False)
    try:
        async for event in sse_events(client, base + "/v1/chat/completions", body,
                                      {"Authorization": f"Bearer {key}"}):
            if event is None:
                res.ok = res.error is None
                break
            if "error" in event:
                res.error = str(event["error"])[:300]
                continue
            if event.get("usage"):
                res.completion_tokens = event["usage"]["completion_tokens"]
                res.prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", ()):
                if choice.get("delta", {}).get("content") and res.ttft is None:
                    res.ttft = time.perf_counter() - t
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - t
    return res


async def plain_request(client, base: str, key: str, item: Item, max_tokens: int) -> dict:
    """A non-streaming chat request: its server-side timings (retrieval, queue, first token, total)."""
    body = {"model": COLLECTION, "messages": [{"role": "user", "content": item.question}], "max_tokens": max_tokens,
            "temperature": 0.0}
    t = time.perf_counter()
    r = await client.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    data = r.json()
    return {**data["timings_ms"], "client_total": (time.perf_counter() - t) * 1000,
            "completion_tokens": data["usage"]["completion_tokens"]}


async def sample_metrics(server: Server, client, samples: list[dict], stop: asyncio.Event, period: float) -> None:
    while not stop.is_set():
        try:
            m = await server.metrics(client)
            samples.append({"running": m["engine"]["num_running"], "waiting": m["engine"]["num_waiting"],
                            "in_flight": m["admission"]["in_flight"], "queued": m["admission"]["queued"],
                            "kv_usage": m["engine"]["kv_cache_usage"]})
        except Exception:  # noqa: BLE001 - a missed sample
            pass
        try:
            await asyncio.wait_for(stop.wait(), period)
        except TimeoutError:
            pass


async def run_level(server: Server, client, keys: list[str], items: list[Item], users: int, max_tokens: int,
                    stop_after: int | None = None, stagger: float = 0.0, sample_period: float = 0.25) -> dict:
    """`users` concurrent users send `items` back to back; with stop_after, the level ends at that many answers.

    User i starts i * stagger / users seconds into the level (the level's clock runs from 0).
    """
    before = await server.metrics(client)
    queue = deque(items)
    results: list[Result] = []
    enough = asyncio.Event()
    samples: list[dict] = []
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(server, client, samples, stop_sampling, sample_period))

    async def user(i: int) -> None:
        if stagger:
            await asyncio.sleep(i * stagger / users)
        while queue and not enough.is_set():
            item = queue.popleft()
            res = await chat_request(client, server.base, keys[item.user], item, max_tokens)
            results.append(res)
            if stop_after is not None and sum(r.ok for r in results) >= stop_after:
                enough.set()

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(user(i)) for i in range(users)]
    all_done = asyncio.gather(*tasks, return_exceptions=True)
    enough_waiter = asyncio.create_task(enough.wait())
    await asyncio.wait([enough_waiter, all_done], return_when=asyncio.FIRST_COMPLETED)
    wall = time.perf_counter() - t0
    enough_waiter.cancel()
    for task in tasks:
        task.cancel()  # users still waiting (stop_after): their requests are dropped, and aborted server-side
    await all_done
    stop_sampling.set()
    await sampler
    # Let cancelled requests leave the server (their slots and KV blocks) before the next level.
    for _ in range(240):
        m = await server.metrics(client)
        if m["admission"]["in_flight"] == 0 and m["admission"]["queued"] == 0 and m["engine"]["num_running"] == 0:
            break
        await asyncio.sleep(0.25)
    after = await server.metrics(client)
    return {**summarize_level(results, wall, users, samples, before, after), "stagger_s": stagger}


def summarize_level(results: list[Result], wall: float, users: int, samples: list[dict], before: dict,
                    after: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    tokens = sum(r.completion_tokens for r in ok)
    eb, ea = before["engine"], after["engine"]
    queried = ea["prefix_cache_queried_tokens"] - eb["prefix_cache_queried_tokens"]
    hit = ea["prefix_cache_hit_tokens"] - eb["prefix_cache_hit_tokens"]
    busy = [s for s in samples if s["running"] > 0]
    finish: dict[str, int] = {}
    for r in ok:
        finish[r.finish_reason or "?"] = finish.get(r.finish_reason or "?", 0) + 1
    return {
        "users": users, "requests": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_s": wall, "completion_tokens": tokens, "tok_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else None,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1000 if ttfts else None,
        "latency_p50_s": percentile(sorted(r.latency for r in ok), 50) if ok else None,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "finish_reasons": finish,
        "prefix_cache_hit_rate": hit / queried if queried else None,
        "prefill_tokens_per_answer": (queried - hit) / len(ok) if ok else None,
        "preemptions": ea["num_preemptions"] - eb["num_preemptions"],
        "batch_running_mean": statistics.fmean(s["running"] for s in busy) if busy else 0.0,
        "batch_running_max": max((s["running"] for s in samples), default=0),
        "engine_waiting_mean": statistics.fmean(s["waiting"] for s in busy) if busy else 0.0,
        "admission_in_flight_mean": statistics.fmean(s["in_flight"] for s in samples) if samples else 0.0,
        "admission_queued_mean": statistics.fmean(s["queued"] for s in samples) if samples else 0.0,
        "kv_usage_max": max((s["kv_usage"] for s in samples), default=0.0),
        "num_samples": len(samples),
        "prompt_tokens_by_index": {r.index: r.prompt_tokens for r in ok},
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest rank, as the engine's metrics compute it."""
    rank = max(1, math.ceil(len(sorted_values) * q / 100))
    return sorted_values[rank - 1]


async def serve_phase(label: str, home: Path, port: int, env: dict[str, str], keys: list[str], warmup: list[Item],
                      levels: list[tuple[int, list[Item]]], args, stop_after: dict[int, int] | None = None,
                      extras: dict[str, list[Item]] | None = None) -> dict:
    """Start a server, warm it up (warmup[:2] one after the other, the rest together), then run each level.

    Users start staggered over the latency of a lone answer (unless --no-stagger; the faster of the
    two lone warm-up answers, the first of which compiles kernels): with
    fixed output lengths, users that start together stay in lockstep, every answer's prefill
    queued behind the others'. `extras` (main server only, after the sweep): "lockstep" runs 8
    users started together, "timings" a few non-streaming answers for the server's own timings.
    """
    import httpx

    server = Server(home, port, env, label)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    out: dict = {"label": label, "levels": {}}
    try:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0)) as client:
            out["startup_s"] = await server.wait_ready(client, timeout=args.startup_timeout)
            log(f"[{label}] ready in {out['startup_s']:.1f} s")
            t = time.perf_counter()
            # Warm-up: one request alone, then the rest at the highest concurrency (graphs, kernels, caches).
            w = await run_level(server, client, keys, warmup[:2], 1, args.output_tokens)
            w2 = await run_level(server, client, keys, warmup[2:], len(warmup) - 2, 16)
            stagger = w["latency_p50_s"] if args.stagger and w["latency_p50_s"] else 0.0
            out["warmup"] = {"s": time.perf_counter() - t, "failed": w["failed"] + w2["failed"],
                             "errors": w["errors"] + w2["errors"], "lone_latency_s": w["latency_p50_s"],
                             "stagger_s": stagger, "requests": len(warmup),
                             "prefix_cache_hit_rate": [w["prefix_cache_hit_rate"], w2["prefix_cache_hit_rate"]]}
            log(f"[{label}] warm-up {out['warmup']['s']:.1f} s ({len(warmup)} requests), failed "
                f"{out['warmup']['failed']} {out['warmup']['errors']}, prefix hit "
                f"{' / '.join(fmt_pct(h) for h in out['warmup']['prefix_cache_hit_rate'])}")
            m = await server.metrics(client)
            out["engine_config"] = m.get("engine_config")
            for users, items in levels:
                k = stop_after.get(users) if stop_after else None
                res = await run_level(server, client, keys, items, users, args.output_tokens, stop_after=k,
                                      stagger=stagger if users > 1 else 0.0)
                out["levels"][users] = res
                log(f"[{label}] {users:3d} users: {res['requests']} answers ({res['failed']} failed) in "
                    f"{res['wall_s']:.1f} s, {res['tok_per_s']:,.0f} tok/s, TTFT p50 {fmt(res['ttft_p50_ms'])} ms "
                    f"p99 {fmt(res['ttft_p99_ms'])} ms, batch {res['batch_running_mean']:.1f} (max "
                    f"{res['batch_running_max']}), engine waiting {res['engine_waiting_mean']:.1f}, admission queue "
                    f"{res['admission_queued_mean']:.1f}, prefix hit {fmt_pct(res['prefix_cache_hit_rate'])}, prefill "
                    f"{fmt(res['prefill_tokens_per_answer'])} tokens/answer, finish {res['finish_reasons']} "
                    f"{res['errors'] or ''}")
            if extras:
                res = await run_level(server, client, keys, extras["lockstep"], 8, args.output_tokens)
                out["lockstep8"] = res
                log(f"[{label}]   8 users started together: TTFT p50 {fmt(res['ttft_p50_ms'])} ms p99 "
                    f"{fmt(res['ttft_p99_ms'])} ms, {res['tok_per_s']:,.0f} tok/s, {res['failed']} failed")
                rows = [await plain_request(client, server.base, keys[it.user], it, args.output_tokens)
                        for it in extras["timings"]]
                out["timings_ms"] = {k: statistics.fmean(r.get(k, 0.0) for r in rows) for k in rows[0]}
                log(f"[{label}] one user, non-streaming, mean server timings (ms): "
                    + ", ".join(f"{k} {v:.1f}" for k, v in out["timings_ms"].items()))
            out["final_metrics"] = await server.metrics(client)
    finally:
        server.stop()
    out["gpu_memory_line"] = next((line.split(": ", 1)[-1] for line in server.log_path.read_text().splitlines()
                                   if "left for the KV cache" in line), None)
    return out


# -- the offline peer ---------------------------------------------------------------------------

def offline_phase(folder: Path, device: str, engine_config: dict, prompts: dict[int, tuple], warmup: list[Item],
                  levels: list[tuple[int, list[Item]]], output_tokens: int, quantization: str | None = None,
                  kv_cache_dtype: str = "auto") -> dict:
    """The engine alone: `users` requests in flight (a new one added as one finishes), same prompts."""
    from generation import LLM, SamplingParams

    llm = LLM(folder, device=device, max_num_seqs=engine_config["max_num_seqs"],
              max_num_batched_tokens=engine_config["max_num_batched_tokens"],
              num_kv_blocks=engine_config["num_kv_blocks"], quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    out: dict = {"levels": {}, "num_kv_blocks": engine.model_runner.num_kv_blocks}

    def closed_loop(items: list[Item], users: int, max_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        before = engine.get_metrics()
        pending = deque(items)
        ttfts: list[float] = []
        tokens = 0
        running_sizes: list[int] = []
        scheduler = engine.scheduler
        active = 0
        t0 = time.perf_counter()

        def top_up() -> int:
            n = 0
            while pending and active + n < users:
                ids, regions = prompts[pending.popleft().index]
                engine.add_request(ids, params, regions, incremental_text=False)
                n += 1
            return n

        active += top_up()
        while active:
            updates = engine.step()
            running_sizes.append(scheduler.num_running)
            for u in updates:
                if u.finished:
                    active -= 1
                    tokens += len(u.output.token_ids)
                    if u.metrics and u.metrics.time_to_first_token is not None:
                        ttfts.append(u.metrics.time_to_first_token)
            active += top_up()
        wall = time.perf_counter() - t0
        after = engine.get_metrics()
        queried = after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
        hit = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        ttfts.sort()
        return {"users": users, "requests": len(items), "wall_s": wall, "completion_tokens": tokens,
                "tok_per_s": tokens / wall, "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
                "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else None,
                "prefix_cache_hit_rate": hit / queried if queried else None,
                "prefill_tokens_per_answer": (queried - hit) / len(items) if items else None,
                "batch_running_mean": statistics.fmean(running_sizes) if running_sizes else 0.0,
                "preemptions": after.num_preemptions - before.num_preemptions}

    # The same warm-up as the servers': the same cache history.
    hits = [closed_loop(warmup[:2], 1, output_tokens), closed_loop(warmup[2:], len(warmup) - 2, 16)]
    out["warmup_prefix_cache_hit_rate"] = [h["prefix_cache_hit_rate"] for h in hits]
    log(f"[offline] warm-up ({len(warmup)} requests): prefix hit "
        f"{' / '.join(fmt_pct(h['prefix_cache_hit_rate']) for h in hits)}")
    for users, items in levels:
        res = closed_loop(items, users, output_tokens)
        out["levels"][users] = res
        log(f"[offline] {users:3d} in flight: {res['requests']} prompts in {res['wall_s']:.1f} s, "
            f"{res['tok_per_s']:,.0f} tok/s, TTFT p50 {fmt(res['ttft_p50_ms'])} ms, batch "
            f"{res['batch_running_mean']:.1f}, prefix hit {fmt_pct(res['prefix_cache_hit_rate'])}, prefill "
            f"{fmt(res['prefill_tokens_per_answer'])} tokens/answer")
    return out


# -- report -------------------------------------------------------------------------------------

def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def report(result: dict) -> str:
    lines = []
    concs = result["concurrency"]
    server = result.get("server", {}).get("levels", {})
    serial = result.get("serialized", {}).get("levels", {})
    offline = result.get("offline", {}).get("levels", {})
    lines.append("| users | server TTFT p50 | p99 | server tok/s | serialized tok/s | offline tok/s | "
                 "server / serialized | server / offline | prefix hit (server / serialized / offline) | "
                 "mean batch (server / offline) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for c in concs:
        s, z, o = server.get(c), serial.get(c), offline.get(c)
        ratio_z = s["tok_per_s"] / z["tok_per_s"] if s and z and z["tok_per_s"] else None
        ratio_o = s["tok_per_s"] / o["tok_per_s"] if s and o and o["tok_per_s"] else None
        answers = f" ({z['requests']} answers)" if z else ""
        lines.append(
            f"| {c} | {fmt(s and s['ttft_p50_ms'])} ms | {fmt(s and s['ttft_p99_ms'])} ms | "
            f"{fmt(s and s['tok_per_s'], ',.0f')} | {fmt(z and z['tok_per_s'], ',.0f')}{answers} | "
            f"{fmt(o and o['tok_per_s'], ',.0f')} | "
            f"{fmt(ratio_z, '.1f')}{'x' if ratio_z else ''} | {fmt_pct(ratio_o)} | "
            f"{fmt_pct(s and s['prefix_cache_hit_rate'])} / {fmt_pct(z and z['prefix_cache_hit_rate'])} / "
            f"{fmt_pct(o and o['prefix_cache_hit_rate'])} | "
            f"{fmt(s and s['batch_running_mean'], '.1f')} / {fmt(o and o['batch_running_mean'], '.1f')} |")
    lock = result.get("server", {}).get("lockstep8")
    if lock:
        lines.append(f"| 8, started together | {fmt(lock['ttft_p50_ms'])} ms | {fmt(lock['ttft_p99_ms'])} ms | "
                     f"{lock['tok_per_s']:,.0f} | | | | | {fmt_pct(lock['prefix_cache_hit_rate'])} / / | "
                     f"{lock['batch_running_mean']:.1f} / |")
    warm = {"server": result.get("server", {}).get("warmup", {}).get("prefix_cache_hit_rate"),
            "serialized": result.get("serialized", {}).get("warmup", {}).get("prefix_cache_hit_rate"),
            "offline": result.get("offline", {}).get("warmup_prefix_cache_hit_rate")}
    lines.append("")
    lines.append("warm-up prefix hit (one answer alone / the rest at once; the same requests in each phase): "
                 + ", ".join(f"{phase} {' / '.join(fmt_pct(h) for h in hits)}" for phase, hits in warm.items() if hits))
    failed = {p: sum(lv["failed"] for lv in result.get(p, {}).get("levels", {}).values())
              for p in ("server", "serialized")}
    lines.append("")
    lines.append(f"failed requests: server {failed['server']}, serialized {failed['serialized']}")
    top = max(concs)
    goals = []
    s, z, o = server.get(top), serial.get(top), offline.get(top)
    if s and z:
        x = s["tok_per_s"] / z["tok_per_s"]
        goals.append(f"{top} users >= {GOAL_SERIALIZED_X:.0f}x serialized: {x:.1f}x -> "
                     f"{'met' if x >= GOAL_SERIALIZED_X else 'NOT met'}")
    if o and z:
        goals.append(f"(the engine alone at {top} in flight: {o['tok_per_s'] / z['tok_per_s']:.1f}x "
                     "the serialized server)")
    if s and o:
        share = s["tok_per_s"] / o["tok_per_s"]
        goals.append(f"{top} users >= {GOAL_OFFLINE_SHARE * 100:.0f}% of offline: {share * 100:.0f}% -> "
                     f"{'met' if share >= GOAL_OFFLINE_SHARE else 'NOT met'}")
    s8 = server.get(8)
    if s8 and s8["ttft_p50_ms"] is not None:
        goals.append(f"p50 TTFT at 8 users <= {GOAL_TTFT_MS:.0f} ms: {s8['ttft_p50_ms']:.0f} ms -> "
                     f"{'met' if s8['ttft_p50_ms'] <= GOAL_TTFT_MS else 'NOT met'}")
    lines.append("")
    lines.extend(f"goal: {g}" for g in goals)
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="2-layer model on the CPU, small sources (a smoke run)")
    ap.add_argument("--concurrency", default=None, help="users per level (default 1,8,32,64; tiny 1,2,4)")
    ap.add_argument("--output-tokens", type=int, default=None, help="tokens per answer (default 128; tiny 8)")
    ap.add_argument("--source-tokens", type=int, default=None, help="tokens per source (default 512; tiny 48)")
    ap.add_argument("--chunks", type=int, default=None, help="chunks in the collection (default 2000; tiny 200)")
    ap.add_argument("--requests-per-user", type=int, default=4, help="answers per user per level (at least 8 a level)")
    ap.add_argument("--serialized-requests", type=int, default=12,
                    help="answers per level for the serialized server (8 at 1 user)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity skew of chunks (0 = uniform)")
    ap.add_argument("--phases", default="server,serialized,offline")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none",
                    help="the engine's weights: fp8 quantizes the bf16 model at load (server and offline peer)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the engine's KV cache dtype")
    ap.add_argument("--no-stagger", dest="stagger", action="store_false",
                    help="start each level's users together (they then stay in lockstep)")
    ap.add_argument("--folder", default=None, help="model folder to reuse (made when empty)")
    ap.add_argument("--home", default=None, help="data directory (default: a temporary one)")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    concs = [int(c) for c in (args.concurrency or ("1,2,4" if args.tiny else "1,8,32,64")).split(",")]
    args.output_tokens = args.output_tokens or (8 if args.tiny else 128)
    args.source_tokens = args.source_tokens or (48 if args.tiny else 512)
    args.chunks = args.chunks or (200 if args.tiny else 2000)
    phases = set(args.phases.split(","))

    import torch

    hardware = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    started = datetime.datetime.now()
    print(f"# {hardware}, torch {torch.__version__}, {started:%Y-%m-%d %H:%M}", flush=True)
    t = time.perf_counter()
    folder, weight_bytes, what = prepare_model(args)
    if args.quantization != "none":
        what += f", served as {args.quantization} weights (quantized at load)"
    if args.kv_cache_dtype != "auto":
        what += f", {args.kv_cache_dtype} KV cache"
    if args.device == "cuda":
        torch.cuda.empty_cache()
    log(f"model {what}, {weight_bytes / 1e9:.2f} GB in {folder} ({time.perf_counter() - t:.1f} s)")

    home = Path(args.home or tempfile.mkdtemp(prefix="serve-load-home-"))
    write_settings(home, args, folder)
    n_users = max(concs)
    t = time.perf_counter()
    keys = build_corpus(home, args.chunks, args.source_tokens, n_users, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    warmup = make_items(rng, 2 + max(concs), n_users, args.chunks, args.zipf, start=0)
    levels: list[tuple[int, list[Item]]] = []
    start = len(warmup)
    for c in concs:
        items = make_items(rng, max(8, c * args.requests_per_user), n_users, args.chunks, args.zipf, start=start)
        start += len(items)
        levels.append((c, items))
    extras = {"lockstep": make_items(rng, 32, n_users, args.chunks, args.zipf, start=start)}
    extras["timings"] = make_items(rng, 4, n_users, args.chunks, args.zipf, start=start + 32)
    all_items = warmup + [it for _, items in levels for it in items] + extras["lockstep"] + extras["timings"]
    prompts = prompt_ids_for(home, folder, keys, all_items)
    lengths = [len(prompts[it.index][0]) for it in all_items]
    log(f"corpus {args.chunks} chunks x {args.source_tokens} tokens, {n_users} users; {len(all_items)} questions, "
        f"prompts {min(lengths)}-{max(lengths)} tokens (mean {statistics.fmean(lengths):.0f}); "
        f"{time.perf_counter() - t:.1f} s")

    result: dict = {"hardware": hardware, "torch": torch.__version__, "date": f"{started:%Y-%m-%d %H:%M}",
                    "model": what, "weight_bytes": weight_bytes, "concurrency": concs,
                    "output_tokens": args.output_tokens, "source_tokens": args.source_tokens, "chunks": args.chunks,
                    "zipf": args.zipf, "prompt_tokens_mean": statistics.fmean(lengths),
                    "stagger": args.stagger,
                    "command": " ".join(sys.argv)}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    engine_config = None
    if "server" in phases:
        result["server"] = asyncio.run(serve_phase("server", home, args.port, {}, keys, warmup, levels, args,
                                                   extras=extras))
        engine_config = result["server"]["engine_config"]
        save()
    if "serialized" in phases:
        stop_after = {c: (8 if c == 1 else args.serialized_requests) for c in concs}
        ser_levels = [(c, items[: max(stop_after[c], c)]) for c, items in levels]
        # The same warm-up as the server's (one answer alone, then the rest at once, queued here
        # behind the one slot): the same cache history before the first level.
        result["serialized"] = asyncio.run(serve_phase(
            "serialized", home, args.port + 1, {"RAG_MAX_CONCURRENT_GENERATIONS": "1"}, keys, warmup,
            ser_levels, args, stop_after=stop_after))
        engine_config = engine_config or result["serialized"]["engine_config"]
        save()
    # Every answer's prompt length as the server reported it against the ids the offline peer uses.
    checked = mismatched = 0
    for phase in ("server", "serialized"):
        lvs = list(result.get(phase, {}).get("levels", {}).values()) + [result.get(phase, {}).get("lockstep8")]
        for lv in filter(None, lvs):
            for index, n in lv["prompt_tokens_by_index"].items():
                checked += 1
                mismatched += n != len(prompts[int(index)][0])
    result["prompt_ids_checked"], result["prompt_ids_mismatched"] = checked, mismatched
    if checked:
        log(f"prompt token counts: {checked - mismatched}/{checked} server answers match the offline peer's ids")
    if "offline" in phases:
        if engine_config is None:
            raise SystemExit("the offline phase takes the server's engine config: run a server phase first")
        result["offline"] = offline_phase(folder, args.device, engine_config, prompts, warmup, levels,
                                          args.output_tokens,
                                          None if args.quantization == "none" else args.quantization,
                                          args.kv_cache_dtype)
        save()
    for phase in ("server", "serialized"):
        lvs = list(result.get(phase, {}).get("levels", {}).values()) + [result.get(phase, {}).get("lockstep8")]
        for lv in filter(None, lvs):
            lv.pop("prompt_tokens_by_index", None)
    save()

    cfg = engine_config or {}
    print()
    print(f"# {hardware}, torch {torch.__version__}, {started:%Y-%m-%d %H:%M}")
    print(f"model: {what} ({weight_bytes / 1e9:.2f} GB); corpus {args.chunks} chunks x {args.source_tokens} tokens, "
          f"5 sources per question (Zipf {args.zipf}), prompts {statistics.fmean(lengths):.0f} tokens on average, "
          f"{args.output_tokens} output tokens (greedy)")
    if cfg:
        print(f"engine: max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens {cfg['max_num_batched_tokens']}, "
              f"{cfg['num_kv_blocks']} KV blocks of {cfg['block_size']} "
              f"({cfg['num_kv_blocks'] * cfg['block_size']:,} tokens), {cfg['num_scheduler_steps']} scheduler steps; "
              f"server: max_concurrent_generations 64 (serialized: 1)")
    print(f"requests per level: server/offline {', '.join(f'{c}: {len(i)}' for c, i in levels)}; serialized "
          f"to the {args.serialized_requests}th answer (8 at 1 user)")
    stagger = result.get("server", {}).get("warmup", {}).get("stagger_s")
    print(f"users start staggered over {stagger:.2f} s (one lone answer)" if stagger else "users start together")
    timings = result.get("server", {}).get("timings_ms")
    if timings:
        print("one user, non-streaming, server timings (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    print(report(result))
    save()


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
    main()
