"""Goodput of one serving replica over HTTP, the way operators measure it (like `vllm bench serve`).

Starts `rag engine serve` (or, with --server rag, the query service `rag serve` as
bench/serve_load_server.py runs it) in its own process, or takes --base-url of a running one, and
runs a closed-loop sweep: at each concurrency N, N clients each send their next streaming request
as soon as their last one finished, until the level's requests are done (the clients start spread
over one lone request's latency, measured at concurrency 1; --no-ramp: all at once). Two workloads:

  random  /v1/completions with random token-id prompts (default 2,048 tokens) and a fixed output
          (default 256 tokens, ignore_eos), `return_token_ids` so every chunk says how many tokens
          it carries (engine server only);
  rag     the RAG-shaped prompts of bench/serve_load.py (system, 5 retrieved sources shared across
          questions by Zipf popularity, the question): to the engine server as the token ids the
          service would send its engine; to `rag serve` as the chat questions themselves.

Per level: p50/p99 TTFT (request sent -> first token), TPOT (per request: time from its first to its
last token / (output tokens - 1)), ITL (gaps between streamed chunks; a chunk may carry several
tokens: the engine decodes up to 8 steps per batch on CUDA), request and output-token throughput,
and goodput: requests/s that met TTFT <= --slo-ttft AND TPOT <= --slo-tpot, and their share. Each
level's throughput is also a ratio of concurrency 1's (the serialized server), and the knee is the
highest concurrency whose p99 TTFT meets the TTFT SLO: a replica's capacity for an autoscaler.
While a level runs, GET /metrics (Prometheus) is sampled: waiting requests and KV cache usage.

--compare-dtypes runs the sweep once per setting (bf16, then fp8 weights and KV cache), each in its
own server process, and prints them side by side.

    PYTHONPATH=. python bench/goodput.py --dummy-shape llama-8b --compare-dtypes --out goodput.json
    PYTHONPATH=. python bench/goodput.py --model /models/Llama-3.1-8B-Instruct --engine-args max_num_seqs=128
    PYTHONPATH=. python bench/goodput.py --tiny       # tiny random Llama on the CPU, end to end
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ siblings: sse

from sse import sse_events  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
READY = re.compile(r"serving (\S+) on (http://\S+/v1)")
SERVED_NAME = "bench"
# What `rag engine serve` imports beyond torch/transformers/tokenizers/safetensors (the GPU machine
# has only those: carry these as wheels, docs/benchmarks.md "Goodput").
SERVER_MODULES = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic_settings", "typer", "prometheus_client",
                  "httpx")
FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}


# -- statistics (pure, tested by hand) ----------------------------------------------------------

@dataclasses.dataclass
class Record:
    """One request as the client saw it: when each chunk with tokens arrived (seconds after sending)."""

    ok: bool
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # empty: counts unknown (chat text)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    latency: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (output tokens - 1), vLLM's TPOT; None with fewer than 2 tokens."""
        if not self.chunk_times or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank (the smallest value with at least q% at or below it), as the engine's metrics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def level_stats(records: list[Record], wall: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """A level's latencies (seconds), throughputs (per second of `wall`) and goodput against the SLO.

    A request meets the SLO when it succeeded, its TTFT <= slo_ttft and its TPOT <= slo_tpot (a
    one-token answer has no TPOT and meets that half). ITLs pool every gap of every request.
    """
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [g for r in ok for g in r.itls]
    tokens = sum(r.completion_tokens for r in ok)
    later_chunks = [n for r in ok for n in r.chunk_tokens[1:]]
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    return {
        "requests": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        # Tokens per chunk after each request's first (the first carries the prefill's one token).
        "tokens_per_chunk": statistics.fmean(later_chunks) if later_chunks else None,
        "request_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tok_per_s": tokens / wall if wall > 0 else 0.0,
        "completion_tokens": tokens,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else None,
        "goodput_per_s": len(good) / wall if wall > 0 else 0.0,
        "goodput_share": len(good) / len(records) if records else None,
    }


def add_ratios(levels: dict[int, dict]) -> None:
    """Each level's output throughput as a ratio of concurrency 1's (the serialized server), when it ran."""
    base = levels.get(1, {}).get("output_tok_per_s")
    for lv in levels.values():
        lv["x_serialized"] = lv["output_tok_per_s"] / base if base else None


def knee(levels: dict[int, dict], slo_ttft: float) -> int | None:
    """The highest concurrency whose p99 TTFT meets the SLO (None if none does)."""
    met = [c for c, lv in levels.items() if lv["ttft_p99_s"] is not None and lv["ttft_p99_s"] <= slo_ttft
           and not lv["failed"]]
    return max(met, default=None)


def prometheus_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The unlabelled samples `name value` of a Prometheus text page for the names asked."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            out[parts[0]] = float(parts[1])
    return out


# -- servers ------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


class EngineServer:
    """`rag engine serve MODEL --port 0 ...` in a subprocess; its base URL from its ready line."""

    def __init__(self, model: Path, device: str, engine_args: dict[str, str], log_path: Path, home: Path) -> None:
        self.log_path = log_path
        # `rag engine serve`, through the console script's entry point (no install needed).
        cmd = [sys.executable, "-c", "from rag.cli import main; main()", "engine", "serve", str(model), "--port", "0",
               "--device", device,
               "--served-model-name", SERVED_NAME, "--log-level", "warning"]
        for key, value in engine_args.items():
            cmd += ["--engine-arg", f"{key}={value}"]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        env.setdefault("RAG_HOME", str(home))
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        log("starting rag " + " ".join(cmd[3:]))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.base: str | None = None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    async def wait_ready(self, client: Any, timeout: float) -> float:
        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            match = READY.search(self.log_path.read_text(errors="replace"))
            if match:
                self.base = match.group(2).removesuffix("/v1")
                return time.perf_counter() - t
            if self.proc.poll() is not None:
                raise RuntimeError(f"rag engine serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            await asyncio.sleep(0.25)
        raise RuntimeError(f"rag engine serve was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- requests -----------------------------------------------------------------------------------

async def stream_completion(client: Any, base: str, prompt: list[int], max_tokens: int,
                            headers: dict[str, str]) -> Record:
    """One streaming /v1/completions of token ids, fixed length (ignore_eos), token ids per chunk."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    return await _stream(client, base + "/v1/completions", body, headers, chat=False)


async def stream_chat(client: Any, base: str, question: str, max_tokens: int, headers: dict[str, str],
                      model: str) -> Record:
    """One streaming chat completion (rag serve): token counts per chunk unknown, the total from usage."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0.0}
    return await _stream(client, base + "/v1/chat/completions", body, headers, chat=True)


async def _stream(client: Any, url: str, body: dict, headers: dict[str, str], chat: bool) -> Record:
    rec = Record(False)
    t = time.perf_counter()
    try:
        async for event in sse_events(client, url, body, headers):
            if event is None:
                rec.ok = rec.error is None
                break
            if "error" in event:
                rec.error = str(event["error"])[:200]
                continue
            if event.get("usage"):
                rec.completion_tokens = event["usage"]["completion_tokens"]
                rec.prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", ()):
                if chat:
                    if choice.get("delta", {}).get("content"):
                        rec.chunk_times.append(time.perf_counter() - t)
                elif choice.get("token_ids"):
                    rec.chunk_times.append(time.perf_counter() - t)
                    rec.chunk_tokens.append(len(choice["token_ids"]))
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.latency = time.perf_counter() - t
    if rec.ok and rec.chunk_tokens and sum(rec.chunk_tokens) != rec.completion_tokens:
        rec.ok, rec.error = False, f"chunks carried {sum(rec.chunk_tokens)} tokens, usage says {rec.completion_tokens}"
    return rec


async def sample_metrics(client: Any, url: str, samples: list[dict], stop: asyncio.Event, period: float) -> None:
    """GET /metrics every `period` s: what an autoscaler would read while the level runs."""
    names = ("rag_engine_num_requests_waiting", "rag_engine_num_requests_running", "rag_engine_kv_cache_usage_ratio",
             "rag_admission_queued")
    while not stop.is_set():
        try:
            r = await client.get(url, timeout=5.0)
            if r.status_code == 200:
                samples.append(prometheus_values(r.text, names))
        except Exception:  # noqa: BLE001 - a missed sample
            pass
        try:
            await asyncio.wait_for(stop.wait(), period)
        except TimeoutError:
            pass


async def run_level(send: Any, payloads: list[Any], concurrency: int, client: Any, metrics_url: str | None,
                    period: float, ramp: float = 0.0) -> tuple[list[Record], float, list[dict]]:
    """Closed loop: `concurrency` clients take the next payload as soon as their last request ended.

    Client i starts i * ramp / concurrency seconds into the level (its clock runs from 0): spread
    over one lone request's latency, clients reach the steady state at once instead of sending
    every prompt in one burst and staying in lockstep (equal output lengths) for the whole level.
    """
    queue = list(reversed(payloads))
    records: list[Record] = []
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(client, metrics_url, samples, stop, period)) if metrics_url else None

    async def user(i: int) -> None:
        if ramp:
            await asyncio.sleep(i * ramp / concurrency)
        while queue:
            records.append(await send(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    stop.set()
    if sampler:
        await sampler
    return records, wall, samples


def sampled(samples: list[dict]) -> dict[str, float | None]:
    def mean(key: str) -> float | None:
        vals = [s[key] for s in samples if key in s]
        return statistics.fmean(vals) if vals else None

    def top(key: str) -> float | None:
        vals = [s[key] for s in samples if key in s]
        return max(vals) if vals else None

    return {"waiting_mean": mean("rag_engine_num_requests_waiting"),
            "waiting_max": top("rag_engine_num_requests_waiting"),
            "running_mean": mean("rag_engine_num_requests_running"),
            "kv_usage_max": top("rag_engine_kv_cache_usage_ratio"), "admission_queued_max": top("rag_admission_queued"),
            "metrics_samples": len(samples)}


# -- workloads ----------------------------------------------------------------------------------

def level_sizes(concs: list[int], per_client: int, minimum: int) -> dict[int, int]:
    return {c: max(minimum, per_client * c) for c in concs}


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    """Token ids drawn uniformly from [100, vocab - 300): clear of the special tokens at either end."""
    lo, hi = 100, max(101, vocab - 300)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(count)]


def rag_workload(args: argparse.Namespace, model_vocab: int, count: int, work: Path) -> dict[str, Any]:
    """bench/serve_load.py's corpus and questions; their prompt token ids as its server would build them.

    The ids come from a tokenizer-only folder (serve_load's one-token-per-word WordLevel tokenizer
    of the model's vocabulary), so they fit the model under test whatever its own tokenizer.
    """
    import numpy as np
    import serve_load

    folder = work / "rag-tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    serve_load.write_tokenizer(folder, model_vocab)
    home = work / "rag-home"
    ns = argparse.Namespace(device="cpu", output_tokens=args.output_len, source_tokens=args.source_tokens)
    serve_load.write_settings(home, ns, folder)
    users = max(args.concurrency_list)
    keys = serve_load.build_corpus(home, args.chunks, args.source_tokens, users, args.seed)
    items = serve_load.make_items(np.random.default_rng(args.seed + 1), count, users, args.chunks, args.zipf)
    return {"home": home, "folder": folder, "keys": keys, "items": items}


def rag_prompt_ids(workload: dict[str, Any]) -> list[list[int]]:
    import serve_load

    prompts = serve_load.prompt_ids_for(workload["home"], workload["folder"], workload["keys"], workload["items"])
    return [list(prompts[it.index][0]) for it in workload["items"]]


# -- the model ----------------------------------------------------------------------------------

def prepare_model(args: argparse.Namespace, work: Path) -> tuple[Path, int, str, dict[str, str]]:
    """The model folder, its vocabulary, a description, and engine args it needs (load_format=dummy)."""
    if args.tiny:
        import serve_load

        folder = work / "tiny-model"
        if not (folder / "config.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            serve_load.make_tiny_model(folder, 128256)
        return folder, 128256, "tiny 2-layer Llama (hidden 64, vocab 128,256), random fp32 weights, no tokenizer", {}
    if args.dummy_shape:
        from engine_llama8b import LLAMA_8B
        from transformers import LlamaConfig

        folder = work / "llama-8b-shape"
        folder.mkdir(parents=True, exist_ok=True)
        config = LlamaConfig(**{"tie_word_embeddings": False, **LLAMA_8B, "torch_dtype": "bfloat16"})
        # No tokenizer: the engine serves token-id prompts only, which is all this bench sends.
        (folder / "config.json").write_text(config.to_json_string())
        return (folder, LLAMA_8B["vocab_size"], "Llama-3.1-8B shape, random weights made on the device "
                "(load_format=dummy)", {"load_format": "dummy"})
    folder = Path(args.model).expanduser()
    config = json.loads((folder / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return folder, int(vocab), f"{folder.name}", {}


def parse_engine_args(text: str | None) -> dict[str, str]:
    """'quantization=fp8,max_num_seqs=128' as a dict (the server checks names and values)."""
    out = {}
    for pair in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-args takes KEY=VALUE[,KEY=VALUE...], got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def settings_of(args: argparse.Namespace, base: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """(label, engine args) per server process: one, or bf16 and fp8 with --compare-dtypes."""
    if args.compare_dtypes:
        plain = "fp32" if args.device == "cpu" else "bf16"
        return [(plain, dict(base)), ("fp8", {**base, **FP8})]
    label = ",".join(f"{k}={v}" for k, v in base.items() if k != "load_format") or "default"
    return [(label, dict(base))]


# -- one setting's sweep ------------------------------------------------------------------------

async def sweep_setting(args: argparse.Namespace, label: str, engine_args: dict[str, str], model: Path,
                        workloads: dict[str, list[Any]], warmup: list[list[int]] | None, work: Path,
                        rag: dict[str, Any] | None) -> dict[str, Any]:
    import httpx

    out: dict[str, Any] = {"label": label, "engine_args": engine_args, "workloads": {}}
    server = None
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout)) as client:
            if args.base_url:
                base = args.base_url.rstrip("/").removesuffix("/v1")
            elif args.server == "engine":
                server = EngineServer(model, args.device, engine_args, work / f"server-{label}.log", work / "home")
                out["startup_s"] = await server.wait_ready(client, args.startup_timeout)
                assert server.base is not None
                base = server.base
            else:
                import serve_load

                assert rag is not None
                env = {f"RAG_ENGINE_{k.upper()}": v for k, v in engine_args.items()}
                server = serve_load.Server(rag["home"], args.port, env, label)
                out["startup_s"] = await server.wait_ready(client, args.startup_timeout)
                base = server.base
            if "startup_s" in out:
                log(f"[{label}] server ready in {out['startup_s']:.1f} s at {base}")
            metrics_url = base + "/metrics"

            if args.server == "engine":
                def send_for(max_tokens: int):
                    return lambda prompt: stream_completion(client, base, prompt, max_tokens, headers)
            else:
                assert rag is not None

                def send_for(max_tokens: int):
                    async def send(item: Any) -> Record:
                        key = rag["keys"][item.user]
                        return await stream_chat(client, base, item.question, max_tokens,
                                                 {"Authorization": f"Bearer {key}"}, "bench")
                    return send

            t = time.perf_counter()
            if warmup:  # kernels, graphs, allocator: one request alone, then a handful at once
                recs, _, _ = await run_level(send_for(16), warmup[:1], 1, client, None, 1.0)
                recs2, _, _ = await run_level(send_for(16), warmup[1:], len(warmup) - 1, client, None, 1.0)
                failed = [r.error for r in recs + recs2 if not r.ok]
                out["warmup"] = {"s": time.perf_counter() - t, "requests": len(warmup), "failed": len(failed),
                                 "errors": failed[:3]}
                log(f"[{label}] warm-up: {len(warmup)} requests in {out['warmup']['s']:.1f} s, {len(failed)} failed "
                    f"{failed[:1] or ''}")
            for name, per_level in workloads.items():
                levels: dict[int, dict] = {}
                ramp = 0.0  # one client alone's p50 latency, once concurrency 1 has run (--no-ramp: none)
                for c in sorted(args.concurrency_list):
                    payloads = per_level[c]
                    records, wall, samples = await run_level(send_for(args.output_len), payloads, c, client,
                                                             metrics_url, args.sample_period, ramp if c > 1 else 0.0)
                    lv = {"concurrency": c, **level_stats(records, wall, args.slo_ttft, args.slo_tpot),
                          **sampled(samples), "ramp_s": ramp if c > 1 else 0.0}
                    if c == 1 and args.ramp:
                        ramp = percentile([r.latency for r in records if r.ok and r.latency], 50) or 0.0
                    levels[c] = lv
                    log(f"[{label}/{name}] {c:4d} clients: {lv['requests']} ok, {lv['failed']} failed in "
                        f"{wall:.1f} s; TTFT p50/p99 {ms(lv['ttft_p50_s'])}/{ms(lv['ttft_p99_s'])} ms, TPOT "
                        f"{ms(lv['tpot_p50_s'], '.1f')}/{ms(lv['tpot_p99_s'], '.1f')} ms, "
                        f"{lv['output_tok_per_s']:,.0f} tok/s, goodput {lv['goodput_per_s']:.2f} req/s "
                        f"({pct(lv['goodput_share'])}), waiting max {num(lv['waiting_max'])}, KV max "
                        f"{pct(lv['kv_usage_max'])} {lv['errors'] or ''}")
                add_ratios(levels)
                out["workloads"][name] = {"levels": levels, "knee": knee(levels, args.slo_ttft)}
    except RuntimeError as exc:  # the server did not start: the other settings still run
        out["error"] = str(exc)
        log(f"[{label}] FAILED: {exc}")
    finally:
        if server is not None:
            server.stop()
    return out


# -- report -------------------------------------------------------------------------------------

def ms(v: float | None, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v * 1000, spec)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def num(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = ("| clients | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | ITL p99 ms "
           "| tok/chunk | req/s | output tok/s | x c=1 | goodput req/s | met SLO | waiting max | KV usage max |")


def table(levels: dict[int, dict]) -> list[str]:
    lines = [COLUMNS, "|" + "---|" * COLUMNS.count(" | ") + "---|"]
    for c, lv in sorted(levels.items()):
        x = lv.get("x_serialized")
        failed = f" ({lv['failed']} failed)" if lv["failed"] else ""
        lines.append(
            f"| {c} | {lv['requests']}{failed} | "
            f"{ms(lv['ttft_p50_s'])} | {ms(lv['ttft_p99_s'])} | {ms(lv['tpot_p50_s'], '.1f')} | "
            f"{ms(lv['tpot_p99_s'], '.1f')} | {ms(lv['itl_p50_s'], '.1f')} | {ms(lv['itl_p99_s'], '.1f')} | "
            f"{num(lv['tokens_per_chunk'], '.1f')} | {lv['request_per_s']:.2f} | {lv['output_tok_per_s']:,.0f} | "
            f"{num(x, '.1f')}{'x' if x is not None else ''} | {lv['goodput_per_s']:.2f} | {pct(lv['goodput_share'])} | "
            f"{num(lv['waiting_max'])} | {pct(lv['kv_usage_max'])} |")
    return lines


def report(result: dict[str, Any]) -> str:
    slo = result["slo"]
    lines = [f"# {result['hardware']}, {result['date']}",
             f"model: {result['model']}; server: {result['server']}; SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= "
             f"{slo['tpot_s'] * 1000:g} ms; closed loop, requests per level {result['requests_per_level']}; "
             + ("each level's clients start spread over one lone request's latency (ramp_s in the JSON)"
                if result["ramp"] else "each level's clients start together"),
             "; ".join(w for w in (
                 f"random: {result['input_len']}-token random prompts, {result['output_len']} output tokens "
                 "(ignore_eos)" if "random" in result["workloads"] else "",
                 f"rag: serve_load's prompts ({result['chunks']} chunks x {result['source_tokens']} tokens, 5 sources "
                 f"per question, Zipf {result['zipf']}), {result['output_len']} output tokens"
                 if "rag" in result["workloads"] else "") if w)]
    for s in result["settings"]:
        if s.get("error"):
            lines += ["", f"## {s['label']}: the server did not run", "", "```", s["error"][-1500:], "```"]
            continue
        for name, w in s["workloads"].items():
            lines += ["", f"## {name} workload, {s['label']} (engine args: {s['engine_args'] or 'none'})", ""]
            lines += table(w["levels"])
            lines += ["", f"knee (highest concurrency with p99 TTFT <= {slo['ttft_s']:g} s): {w['knee'] or 'none'}"]
    ok = [s for s in result["settings"] if not s.get("error")]
    if len(ok) > 1:
        lines += ["", "## side by side: output tok/s, goodput req/s, p99 TTFT ms", ""]
        head = ("| workload | clients | " + " | ".join(s["label"] for s in ok)
                + f" | {ok[-1]['label']} / {ok[0]['label']} |")
        lines += [head, "|" + "---|" * (len(ok) + 3)]
        for name in ok[0]["workloads"]:
            for c in sorted(ok[0]["workloads"][name]["levels"]):
                cells = []
                for s in ok:
                    lv = s["workloads"].get(name, {}).get("levels", {}).get(c)
                    cells.append("-" if lv is None else f"{lv['output_tok_per_s']:,.0f} tok/s, "
                                 f"{lv['goodput_per_s']:.2f} good/s, {ms(lv['ttft_p99_s'])} ms")
                first = ok[0]["workloads"][name]["levels"][c]["output_tok_per_s"]
                last = ok[-1]["workloads"].get(name, {}).get("levels", {}).get(c, {}).get("output_tok_per_s")
                ratio = f"{last / first:.2f}x" if first and last else "-"
                lines.append(f"| {name} | {c} | " + " | ".join(cells) + f" | {ratio} |")
            lines.append(f"| {name} | knee | " + " | ".join(str(s["workloads"].get(name, {}).get("knee")) for s in ok)
                         + " | |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> str:
    """Output tok/s against p99 TTFT, one line per workload and setting, points labelled by concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in result["settings"]:
        for name, w in s.get("workloads", {}).items():
            pts = [(lv["ttft_p99_s"], lv["output_tok_per_s"], c) for c, lv in sorted(w["levels"].items())
                   if lv["ttft_p99_s"] is not None]
            if not pts:
                continue
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name}, {s['label']}")
            for x, y, c in pts:
                ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                            color=line.get_color())
    ax.axvline(result["slo"]["ttft_s"], color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("p99 time to first token (s)")
    ax.set_ylabel("output tokens/s")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(result["model"], 110) + textwrap.wrap(result["hardware"], 110)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--model", help="a model folder (Hugging Face layout)")
    what.add_argument("--dummy-shape", choices=["llama-8b"], help="random weights of this shape made on the device")
    what.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU, a few requests")
    ap.add_argument("--server", choices=["engine", "rag"], default="engine",
                    help="engine: `rag engine serve` (both workloads); rag: `rag serve` (the rag workload)")
    ap.add_argument("--base-url", help="a running server instead of starting one (http://HOST:PORT)")
    ap.add_argument("--api-key", default=os.environ.get("RAG_ENGINE_API_KEY"), help="for --base-url")
    ap.add_argument("--vocab", type=int, default=32000, help="for --base-url: random prompt ids stay below it")
    ap.add_argument("--engine-args", default="", help="engine options, KEY=VALUE,... (e.g. max_num_seqs=128)")
    ap.add_argument("--compare-dtypes", action="store_true",
                    help="two server processes: as given (bf16), then quantization=fp8,kv_cache_dtype=fp8")
    ap.add_argument("--workloads", default=None, help="random,rag (default: both on the engine, rag on rag serve)")
    ap.add_argument("--concurrency", default=None, help="clients per level (default 1,8,32,64,128; tiny 1,2,4)")
    ap.add_argument("--requests-per-client", type=int, default=2, help="a level sends max(min, this x clients)")
    ap.add_argument("--min-requests", type=int, default=None, help="fewest requests per level (default 8; tiny 4)")
    ap.add_argument("--input-len", type=int, default=None, help="random prompt tokens (default 2048; tiny 64)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 256; tiny 8)")
    ap.add_argument("--source-tokens", type=int, default=None, help="rag: tokens per source (default 512; tiny 48)")
    ap.add_argument("--chunks", type=int, default=None, help="rag: chunks in the corpus (default 2000; tiny 200)")
    ap.add_argument("--zipf", type=float, default=1.0, help="rag: popularity skew of chunks")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.050, help="TPOT SLO, seconds")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--no-ramp", dest="ramp", action="store_false",
                    help="start a level's clients together (one burst of prompts) instead of spread over one lone "
                    "request's latency (taken from concurrency 1)")
    ap.add_argument("--sample-period", type=float, default=0.25, help="seconds between /metrics samples")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--device", default=None, help="the server's device (default: cuda when available; tiny: cpu)")
    ap.add_argument("--port", type=int, default=8411, help="rag serve's port (the engine server picks a free one)")
    ap.add_argument("--work", default=None, help="folder for models, corpus and logs (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write all results as JSON here (and the plot next to it)")
    args = ap.parse_args(argv)
    if not (args.model or args.dummy_shape or args.tiny or args.base_url):
        ap.error("give --model, --dummy-shape, --tiny or --base-url")
    if args.device is None:
        import torch

        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    concs = args.concurrency or ("1,2,4" if args.tiny else "1,8,32,64,128")
    args.concurrency_list = [int(c) for c in concs.split(",")]
    args.min_requests = args.min_requests or (4 if args.tiny else 8)
    args.input_len = args.input_len or (64 if args.tiny else 2048)
    args.output_len = args.output_len or (8 if args.tiny else 256)
    args.source_tokens = args.source_tokens or (48 if args.tiny else 512)
    args.chunks = args.chunks or (200 if args.tiny else 2000)
    default_workloads = "random,rag" if args.server == "engine" else "rag"
    args.workload_list = (args.workloads or default_workloads).split(",")
    if args.server == "rag" and "random" in args.workload_list:
        ap.error("rag serve answers chat questions only: --workloads rag")
    if args.server == "rag" and not (args.tiny or args.dummy_shape):
        ap.error("--server rag writes its own model folder (serve_load's tokenizer): use --tiny or --dummy-shape")
    return args


def missing_modules() -> list[str]:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sys.path[:0] = [p for p in (str(BENCH), str(REPO)) if p not in sys.path]
    from machine import describe_machine

    if missing_modules():
        raise SystemExit(f"missing Python packages for the server and client: {', '.join(missing_modules())} "
                         "(on the GPU machine install the wheels of docs/benchmarks.md 'Goodput')")
    started = datetime.datetime.now()
    hardware = describe_machine(use_gpu=args.device == "cuda")
    print(f"# {hardware}, {started:%Y-%m-%d %H:%M}", flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    base_args = parse_engine_args(args.engine_args)

    rag_state = None
    if args.server == "rag":
        import serve_load

        ns = argparse.Namespace(tiny=args.tiny, folder=str(work / "rag-model"))
        model, weight_bytes, what = serve_load.prepare_model(ns)
        vocab, extra = 128256, {}
        unsupported = sorted(set(base_args) - {"max_num_seqs", "num_kv_blocks", "kv_reuse", "host_kv_blocks"})
        if unsupported or args.compare_dtypes:
            raise SystemExit(f"rag serve takes only the engine settings max_num_seqs, num_kv_blocks, kv_reuse, "
                             f"host_kv_blocks, not {', '.join(unsupported) or 'fp8'}")
    elif args.base_url:
        model, vocab, what, extra = Path("."), args.vocab, args.base_url, {}
    else:
        model, vocab, what, extra = prepare_model(args, work)
    log(f"model: {what} ({model})")

    sizes = level_sizes(args.concurrency_list, args.requests_per_client, args.min_requests)
    rng = random.Random(args.seed)
    workloads: dict[str, dict[int, list[Any]]] = {}
    warm_count = 1 + min(8, max(args.concurrency_list))
    warmup = random_prompts(rng, warm_count, args.input_len, vocab) if args.warmup else None
    if "random" in args.workload_list:
        workloads["random"] = {c: random_prompts(rng, n, args.input_len, vocab) for c, n in sizes.items()}
    if "rag" in args.workload_list:
        t = time.perf_counter()
        total = sum(sizes.values())
        if args.server == "rag":
            import serve_load

            rag_state = rag_workload(args, vocab, total + warm_count, work)
            # The server answers from this home: its settings name the server's model folder.
            ns = argparse.Namespace(device=args.device, output_tokens=args.output_len, source_tokens=args.source_tokens)
            serve_load.write_settings(rag_state["home"], ns, model)
            payloads = list(rag_state["items"][:total])
            if args.warmup:
                warmup = rag_state["items"][total:]  # the chat route takes questions, not ids
        elif vocab < 100_000 + args.chunks + 5:
            log(f"rag workload skipped: it needs a vocabulary of at least {100_000 + args.chunks + 5} "
                f"(serve_load's words), the model has {vocab}")
            payloads = []
        else:
            payloads = rag_prompt_ids(rag_workload(args, vocab, total, work))
        if payloads:
            it = iter(payloads)
            workloads["rag"] = {c: [next(it) for _ in range(n)] for c, n in sizes.items()}
            if args.server == "engine":
                lens = [len(p) for p in payloads]
                log(f"rag workload: {len(payloads)} prompts of {min(lens)}-{max(lens)} tokens "
                    f"(mean {statistics.fmean(lens):.0f}), built in {time.perf_counter() - t:.1f} s")

    result: dict[str, Any] = {
        "hardware": hardware, "date": f"{started:%Y-%m-%d %H:%M}", "model": what, "server": args.server,
        "command": " ".join(sys.argv), "concurrency": args.concurrency_list, "requests_per_level": sizes,
        "input_len": args.input_len, "output_len": args.output_len, "source_tokens": args.source_tokens,
        "chunks": args.chunks, "zipf": args.zipf, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "workloads": list(workloads), "ramp": args.ramp,
        "settings": []}
    out_path = Path(args.out) if args.out else None

    def save() -> None:
        if out_path:
            out_path.write_text(json.dumps(result, indent=1, default=str))

    for label, engine_args in settings_of(args, {**extra, **base_args}):
        result["settings"].append(asyncio.run(sweep_setting(args, label, engine_args, model, workloads, warmup, work,
                                                            rag_state)))
        save()
    print()
    print(report(result))
    print()
    print(plot(result, (out_path.with_suffix(".png") if out_path else work / "goodput.png")))
    save()
    return result


if __name__ == "__main__":
    sys.path[:0] = [str(BENCH), str(REPO)]
    main()
