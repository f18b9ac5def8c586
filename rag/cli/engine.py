"""`rag engine serve MODEL`: our generation engine alone behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from rag.errors import ConfigError

engine_app = typer.Typer(
    help="The generation engine as a standalone OpenAI-compatible server (like `vllm serve`): run it on a "
    "GPU node and point RAG services at it with generator_backend = 'remote'.",
    no_args_is_help=True,
)

DEFAULT_MODEL = "default"


@engine_app.callback()
def _engine() -> None:
    # A callback keeps `serve` a subcommand (typer collapses a one-command app into that command).
    pass


@engine_app.command("serve")
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(
        help="a local Hugging Face model folder, a .gguf file (converted once into the data directory), "
        "or 'default' for the packaged SmolLM2-135M-Instruct")],
    host: Annotated[str, typer.Option(help="bind address; 0.0.0.0 to serve other machines")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port (0 picks a free one; the ready line says "
                                      "which)")] = 8001,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="RAG_ENGINE_API_KEY", show_envvar=True,
        help="require `Authorization: Bearer KEY` on /v1/* and /metrics/engine. Prefer the environment variable "
        "or --api-key-file: a key on the command line shows in `ps`")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="read the key from the first line of this file")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="the model id clients send and /v1/models lists (default: the model "
        "folder's name)")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1 or cpu (default: cuda when available)")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        "--max-num-seqs", min=1, help="most requests decoding at once (default 256)")] = None,
    num_kv_blocks: Annotated[int | None, typer.Option(
        "--num-kv-blocks", min=1, help="KV cache blocks of 16 tokens (default: sized from free GPU memory; "
        "a modest default on CPU)")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", min=2, help="most tokens of one request, prompt + output (default: the model's "
        "context, lowered to what the KV cache holds)")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option(
        "--engine-arg", help="any EngineConfig field as KEY=VALUE, repeatable (e.g. quantization=fp8, "
        "kv_cache_dtype=fp8, load_format=dummy, max_num_batched_tokens=4096; 'none' for None)")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level (info shows each request)")] = "info",
) -> None:
    """Load MODEL once and serve it over the OpenAI API at http://HOST:PORT/v1.

    Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions
    (streaming with `stream: true`), GET /health, GET /metrics/engine
    (the engine's counters as JSON) and GET /metrics (Prometheus text: queue,
    running, KV cache usage, TTFT histogram; no key).

    A request's `cache_salt` field is its prefix-cache namespace: only requests
    with the same salt share cached KV. Any holder of the key may send any salt,
    so give the key only to a trusted front end (the RAG service), which derives
    salts from its users' identities.

    Prints `serving NAME on http://HOST:PORT/v1` once it accepts requests.
    """
    import uvicorn

    from generation.config import EngineConfig
    from generation.engine.async_engine import AsyncLLMEngine
    from generation.engine.llm_engine import LLMEngine
    from generation.engine.startup_heap import freeze_startup_heap
    from generation.loader import resolve_model_dir
    from rag.engine_server import create_engine_app
    from rag.settings import load_settings

    settings = load_settings(home=ctx.find_root().params.get("home"))
    key = _read_key(api_key, api_key_file)
    if key is None and not _is_loopback(host):
        typer.echo(f"warning: serving on {host} without an API key: anyone who reaches this port may generate "
                   "and choose cache salts (set RAG_ENGINE_API_KEY or --api-key-file)", err=True)
    extra = parse_engine_args(engine_arg or [])
    if extra.get("load_format") == "dummy" and Path(model).expanduser().is_dir():
        # Random weights from config.json alone: no checkpoint to look for (the loader checks config.json).
        model_dir = Path(model).expanduser()
    else:
        model_dir = resolve_model_dir(None if model == DEFAULT_MODEL else model, settings.model_cache)
    overrides = {"device": device or settings.device, "max_num_seqs": max_num_seqs or settings.engine_max_num_seqs,
                 "num_kv_blocks": num_kv_blocks or settings.engine_num_kv_blocks, "max_model_len": max_model_len,
                 "max_num_batched_tokens": settings.engine_max_num_batched_tokens}  # --engine-arg wins
    both = sorted(k for k in extra if k in ("device", "max_num_seqs", "num_kv_blocks", "max_model_len")
                  and {"device": device, "max_num_seqs": max_num_seqs, "num_kv_blocks": num_kv_blocks,
                       "max_model_len": max_model_len}[k] is not None)
    if both:
        raise ConfigError(f"{', '.join(both)} given both as an option and by --engine-arg: give it once")
    overrides = {k: v for k, v in overrides.items() if v is not None} | extra
    try:
        config = dataclasses.replace(EngineConfig(), **overrides)
    except ValueError as e:
        raise ConfigError(f"invalid engine setting: {e}") from e
    name = served_model_name or model_dir.name
    typer.echo(f"loading {model_dir} ...", err=True)
    engine = AsyncLLMEngine(LLMEngine(model_dir, config), settings.engine_switch_interval_ms)
    freeze_startup_heap()  # the model and modules stay out of the full GCs of serving
    app = create_engine_app(engine, name, key, owns_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    try:
        asyncio.run(_serve(server, name, host))
    finally:
        engine.shutdown()


async def _serve(server, name: str, host: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        typer.echo(f"serving {name} on http://{shown}:{port}/v1")
    await task


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """`--engine-arg KEY=VALUE` pairs as EngineConfig overrides, each value of its field's type.

    Booleans take true/false (1/0, yes/no); 'none' (or 'null') is None; a field whose default is
    None takes an int, a float, or else the string.

    Raises:
        ConfigError: no '=', an unknown field, or a value that is not of the field's type.
    """
    from generation.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not sep or not key:
            raise ConfigError(f"--engine-arg takes KEY=VALUE, got {pair!r}")
        if key not in defaults:
            raise ConfigError(f"--engine-arg: EngineConfig has no field {key!r}; valid: {', '.join(sorted(defaults))}")
        out[key] = _engine_value(key, raw, defaults[key])
    return out


def _engine_value(key: str, raw: str, default: Any) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    if isinstance(default, bool):
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--engine-arg {key} takes true or false, got {raw!r}")
    kinds: tuple[type, ...] = (int, float, str) if default is None else (type(default),)
    if float in kinds and int not in kinds:
        kinds = (float,)
    for kind in kinds:
        try:
            return kind(raw)
        except ValueError:
            continue
    raise ConfigError(f"--engine-arg {key} takes a {type(default).__name__}, got {raw!r}")


def _read_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    if api_key_file is not None:
        if api_key:
            raise ConfigError("give the key by --api-key (or RAG_ENGINE_API_KEY) or by --api-key-file, not both")
        from rag.settings import warn_if_readable_by_others

        warn_if_readable_by_others(api_key_file, "--api-key-file")
        try:
            key = api_key_file.read_text().strip().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {e.strerror}") from e
        if not key or not key[0].strip():
            raise ConfigError(f"--api-key-file {api_key_file} is empty")
        return key[0].strip()
    return api_key or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main() -> None:
    """`python -m rag.cli.engine serve ...`: the same as `rag engine serve ...`."""
    from rag.errors import RagError

    for name, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TQDM_DISABLE", "1")):
        os.environ.setdefault(name, value)
    try:
        engine_app()
    except RagError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
