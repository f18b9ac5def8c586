"""Settings: the only module that reads the environment (RAG_* variables) and the TOML file.

Everything of the embedded default lives under one data directory (`RAG_HOME`, default
`./.rag`): the SQLite catalog, Faiss index files and converted model caches. A `rag.toml`
in that directory (or the file named by `RAG_CONFIG`) may set any field; environment
variables override the file, and CLI flags override both.
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rag.errors import ConfigError
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS

# The most hits a query may hand the reranker (the setting, Rag.query, experiment configs): every
# candidate is a cross-encoder forward pass, so more than this is a mistake, not a tuning.
MAX_CANDIDATES = 1000
MAX_HITS_PER_DOCUMENT = 100  # most hits of one document in a result (0 = no cap)


def check_max_hits_per_document(value: object) -> int:
    """`value` if it is a whole number in 0..MAX_HITS_PER_DOCUMENT (0: no cap), else ConfigError saying so.

    For the callers that bypass the setting's own validation (Rag.query, experiment configs).
    """
    # bool is an int in Python: True would quietly mean a cap of 1.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HITS_PER_DOCUMENT:
        raise ConfigError(f"max_hits_per_document must be a whole number between 0 and {MAX_HITS_PER_DOCUMENT} "
                          f"(0: no cap), got {value!r}")
    return value


class Settings(BaseSettings):
    """Every knob of the framework, with defaults that run the embedded setup."""

    model_config = SettingsConfigDict(env_prefix="RAG_", extra="forbid", frozen=True)

    home: Path = Field(default=Path(".rag"), description="data directory of the embedded default")
    # The data directory and everything in it are owner-only (0700 / 0600). An existing one that
    # other users may read is made owner-only with a warning ("fix"), or refused ("refuse", for
    # operators who want to look into it first). It must belong to the user running rag.
    home_permissions: Literal["fix", "refuse"] = "fix"
    collection: str = Field(default="default", description="collection used when none is named")
    # Models: a local Hugging Face folder each; None means the packaged default
    # (all-MiniLM-L6-v2, ms-marco-MiniLM-L-12-v2, SmolLM2-135M-Instruct).
    embedder: str | None = Field(default=None, description=(
        "local HF encoder folder; \"bge-small-en\" for the packaged BGE (converted once); unset: all-MiniLM-L6-v2"))
    reranker: str | None = Field(default=None, description="local HF cross-encoder folder")
    generator: str | None = Field(default=None, description="local HF causal-LM folder or .gguf file")
    device: str | None = Field(default=None, description="cpu or cuda; None = cuda when available")
    # What citations call a source: its path under the ingest root ("lab-docs/imaging/a.md"),
    # or, for a source tree published elsewhere, that tree's URL plus the relative path:
    # {"/data/lab-docs" = "https://wiki.example.org/docs"}. Never the absolute server path.
    source_urls: dict[str, str] = Field(default_factory=dict)
    chunk_max_tokens: int = Field(default=200, ge=16, le=512)
    # Sources larger than this (a file's bytes, a JSONL record's text) are skipped and reported;
    # a stored version of one stays as it was. 0 turns the cap off. Text and Markdown stream with
    # bounded memory at any size; PDF, DOCX and HTML are parsed whole, at several times their size.
    max_document_bytes: int = Field(default=100 * 1024 * 1024, ge=0)
    chunk_overlap_tokens: int = Field(default=32, ge=0, le=255)
    # Head each section's chunks with "page title › section heading" rather than the heading
    # alone ("CREATE INDEX › Examples", not "Examples"). Changing it re-chunks and re-embeds a
    # collection on its next ingest (a new version, built beside the live one).
    chunk_title_context: bool = True
    # Chunks per embed call of `rag ingest`, each committed when it returns (a killed run redoes
    # at most one). None: 256 on a CPU (~8 s of work), 4096 on a GPU, where small calls leave it
    # idle (bench/ingest_gpu.py).
    ingest_batch_chunks: int | None = Field(default=None, ge=1, le=65536)
    # Sources `rag ingest` parses ahead, whose texts the chunker tokenizes in one batch call
    # (the tokenizer's threads work on it); 1 parses and tokenizes one source at a time, as
    # before (bench/ingest_gpu.py --chunk-batch 1 measures that path). The chunks are the same.
    ingest_chunk_batch: int = Field(default=256, ge=1, le=65536)
    # Processes that parse the sources of `rag ingest` (PDF, DOCX and HTML parsing holds the GIL):
    # "auto" = the CPUs this process may run on (its affinity mask), at most SLURM_CPUS_PER_TASK
    # inside a Slurm job; 1 parses in the ingest process itself. Needs ingest_chunk_batch > 1.
    # See `ingest_worker_count`.
    ingest_workers: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = "auto"
    # Embed each batch on a thread of its own while `rag ingest` reads, chunks and writes the
    # others (on a GPU node the embedder otherwise waits for all of that); false does one thing
    # at a time. The rows are the same either way.
    ingest_overlap_embedding: bool = True
    # With the overlap, write each embedded batch into the store on one writer thread of its own
    # too, in order, while `rag ingest` reads and chunks the next documents (on a GPU node the
    # reading, chunking and writing on one thread were the bound); false writes on the reading
    # thread. The rows are the same either way.
    ingest_write_behind: bool = True
    # Run the embedder of `rag ingest` in a process of its own (spawned; this one keeps only the
    # tokenizer the chunker counts with): its many short GPU launches then never wait for the GIL
    # of the reading, chunking and writing. None = where the embedder runs on a GPU. The model
    # loads while the sources are walked; the vectors are the same.
    ingest_embed_process: bool | None = None
    # While an overlapped embed thread runs, the interpreter's GIL switch interval in ms (its
    # default is 5): the embedder's short GPU launches each need the GIL back and would otherwise
    # wait up to the whole interval beside the chunking and writing (rag/switch_interval.py,
    # bench/gil_switch.py). 0 leaves the interpreter's own.
    ingest_switch_interval_ms: float = Field(default=OVERLAP_SWITCH_INTERVAL_MS, ge=0.0, le=100.0)
    # One ingest run deletes at most this share of a collection's documents (of its shard, in
    # a job array); past it, nothing is deleted and the run fails, unless --allow-mass-delete.
    # A mount that vanished looks like every file deleted; 1.0 turns the share check off.
    max_delete_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    embed_batch_size: int = Field(default=64, ge=1, le=4096)
    # GPU embedding: "auto" = bf16/fp16 on GPUs, fp32 on CPU; the GPUs bulk embedding spreads
    # over (one process each; None = every visible GPU); padded tokens per forward pass
    # (None = embed_batch_size x 256; ~4x that suits small models like MiniLM on a big GPU).
    embed_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # auto: bf16 on GPUs (fp16 where they lack it) and on CPUs with native bf16 (AVX512-BF16 /
    # AMX; autocast, fp32 head), fp32 on other CPUs. Scores within 0.05 logits of fp32
    # (docs/benchmarks.md); on a CPU each pair is scored alone (retrieval.rerank).
    rerank_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    embed_devices: list[str] | None = None
    embed_max_batch_tokens: int | None = Field(default=None, ge=64)
    top_k: int = Field(default=5, ge=1, le=100, description="sources given to the generator")
    candidates: int = Field(default=20, ge=1, le=MAX_CANDIDATES, description="hits fetched before reranking")
    rerank: bool = True
    # At most this many of the top_k sources from one document (0: no cap), filled from the
    # next candidates (searched deeper when those come from too few documents); and whether the
    # reranker's order is fused (RRF) with the retrieval order instead of replacing it. With the
    # default of 1, pages are ranked by their best chunk in each order (plus `page_evidence`
    # times their second-best chunk's share), and the answer reads each source page's next-best
    # candidate chunk with it when that chunk ranks above the weakest source shown
    # (retrieval/second_chunks.py). Measured on the PostgreSQL manual set (recall@5 by page
    # 0.905 against 0.869 with 2; extractive answers 15 of 64 expected facts against 13) and the
    # sample corpus (recall@5 0.992 against 0.971; 25 of 32 facts either way), docs/benchmarks.md.
    max_hits_per_document: int = Field(default=1, ge=0, le=MAX_HITS_PER_DOCUMENT)
    page_evidence: float = Field(default=0.0, ge=0.0, le=1.0)
    fuse_rerank: bool = True
    # Hybrid mode only: also fuse a dense search from the question's vector moved toward the
    # first pass's 5 best readable hits (pseudo-relevance feedback, retrieval/feedback.py), which
    # reaches pages whose words the question does not use. Measured on the same set.
    dense_feedback: bool = True
    # Reranked sources scoring below this are dropped before generation (None keeps all).
    # The default suits ms-marco cross-encoders, whose logits for unrelated text are far below 0.
    min_rerank_score: float | None = -5.0
    # How answers are written: "generate" (the generator's own words), "extract" (the sources'
    # best-supported sentences quoted with their [n], scored by the cross-encoder; "I don't know"
    # below a floor), or "auto": extract when the generator is the packaged SmolLM2-135M or a
    # local model under 1B parameters, generate with a larger model or a remote one (rag/answer_mode.py).
    answer_mode: Literal["auto", "generate", "extract"] = "auto"
    max_new_tokens: int = Field(default=128, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=5.0)
    context_tokens: int = Field(default=1400, ge=64, description="budget for packed sources in the prompt")
    # Where chunks live: "faiss" (exact, the embedded default), "faiss-hnsw" / "faiss-ivf"
    # (approximate, for large collections), "memory" (nothing persisted but the catalog),
    # or "pgvector" (a PostgreSQL server: `dsn`, or the local one of `rag db start`).
    store: Literal["faiss", "faiss-hnsw", "faiss-ivf", "memory", "pgvector"] = "faiss"
    dsn: str | None = Field(default=None, description="PostgreSQL URL for store = pgvector")
    # store = "faiss-ivf" on a GPU (the `faiss-gpu` extra): "auto" trains, fills and searches the
    # IVF lists on the GPU once a collection holds 1M vectors and Faiss sees a GPU; "on" insists
    # (an error with the install hint without one); "off" keeps everything on the CPU. The saved
    # index is a CPU one either way.
    faiss_gpu: Literal["auto", "off", "on"] = "auto"
    # store = "pgvector": the most maintenance_work_mem (MB) each index build after a bulk load may
    # ask the server for (the HNSW graph and the keyword index, built side by side, so up to twice
    # this at once). Below it, what the graph needs; an HNSW graph of 1M x 384-d chunks is ~2.1 GB
    # at pg_hnsw_m 16 (2.6 GB at 32), and one that does not fit is built far slower. Raise it
    # where the server has the memory.
    pg_index_memory_mb: int = Field(default=1024, ge=64, le=1_048_576)
    # store = "pgvector": the HNSW graph of each collection's vector index. `pg_hnsw_m`: links a
    # chunk keeps (2m on the bottom layer; a larger index), `pg_hnsw_ef_construction`: candidates
    # each insert weighs (at least 2 x m); both buy recall at a given search width for a slower
    # build. Options of CREATE INDEX only: an existing index keeps what it was built with, and a
    # new collection or the next version of one (a re-embed or re-chunk) is built with these.
    # Measured at 1M chunks (docs/benchmarks.md): ef_construction 64 (pgvector's default) gave
    # recall@10 0.92 for broad readers, 128 gave 0.995-0.996 for about twice the build time; 64 suits
    # fast bulk loads of small collections, more than 128 collections well past 1M chunks.
    pg_hnsw_m: int = Field(default=16, ge=2, le=100)
    pg_hnsw_ef_construction: int = Field(default=128, ge=4, le=1000)
    # Retrieval legs: dense (embeddings), keyword (BM25 / full text) or hybrid (both, RRF).
    mode: Literal["dense", "keyword", "hybrid"] = "hybrid"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # The generator: "local" (our engine in this process, continuous batching) or "remote"
    # (any OpenAI-compatible server at generator_url: vLLM, SGLang, TGI, llama.cpp, LiteLLM,
    # `rag engine serve`). The key comes from the environment (RAG_GENERATOR_API_KEY) or a file
    # (generator_api_key_file), never from the command line, and is never logged.
    generator_backend: Literal["local", "remote"] = "local"
    generator_url: str | None = Field(default=None, description="base URL of the remote server, e.g. http://gpu01:8000/v1")
    generator_model: str | None = Field(default=None, description="model id on the remote server (default: its first)")
    generator_api_key: SecretStr | None = Field(default=None, description="bearer key of the remote server")
    generator_api_key_file: Path | None = Field(default=None, description="file holding that key")
    # Remote servers take one cache salt per request (vLLM's cache_salt): "user" salts every
    # request per principal (no KV shared across users there), "off" sends none.
    generator_cache_salt: Literal["user", "off"] = "user"
    generator_timeout: float = Field(default=120.0, gt=0, description="seconds a remote call may take")
    # Local engine sizing (None = the engine's defaults, sized from free memory on a GPU).
    engine_max_num_seqs: int | None = Field(default=None, ge=1, le=4096)
    engine_num_kv_blocks: int | None = Field(default=None, ge=1)
    # Most tokens one engine step computes (prefill chunks plus one per decode; None: the engine's
    # 8,192). Higher lets more queued prompts start per step at the price of longer steps (TPOT).
    engine_max_num_batched_tokens: int | None = Field(default=None, ge=16, le=1 << 20)
    # How the local engine reuses retrieved chunks' KV: "exact" (a shared prefix only) or
    # "chunks" (a chunk's KV at any position, its first block recomputed: an approximation; see
    # README "Chunk KV reuse at any position" and its quality table before switching it on).
    engine_kv_reuse: Literal["exact", "chunks"] = "exact"
    # KV blocks evicted from the GPU kept in (pinned) host memory and copied back on a hit; 0 = off.
    # Each block costs layers x 2 x block_size x kv_heads x head_dim x dtype bytes (2 MiB for an 8B model).
    engine_host_kv_blocks: int = Field(default=0, ge=0)
    # FP8 for the local engine (Hopper/Ada GPUs; on CPU a reference path): "fp8" runs the decoder's
    # linear layers in e4m3 (a bf16 checkpoint is quantized at load; an FP8 checkpoint is always
    # FP8); engine_kv_cache_dtype "fp8" stores KV in e4m3, twice the tokens per GiB.
    engine_quantization: Literal["fp8"] | None = None
    engine_kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # The GIL switch interval (ms) while a local engine steps on a GPU beside the service's event
    # loop: each of a step's torch launches gives the GIL up and may wait this long to get it back
    # (rag/switch_interval.py). 0 leaves the interpreter's 5 ms. On an H100, bench/serve_load.py at
    # 64 users in FP8: 1,548 and 1,521 output tok/s at 0.1 ms against 1,337 and 1,437 at 5 ms.
    engine_switch_interval_ms: float = Field(default=0.1, ge=0.0, le=100.0)
    # Admission control of the query service: generations in flight, and requests waiting for
    # one; past both, 429 with Retry-After. Each request has a deadline (504 past it).
    max_concurrent_generations: int = Field(default=64, ge=1, le=4096)
    max_queued_generations: int = Field(default=256, ge=0, le=100000)
    request_timeout: float = Field(default=300.0, gt=0, description="seconds one query may take in all")
    # The largest request body the API reads (413 past it), after the key is checked. Chat front
    # ends resend the whole conversation each turn; 2 MB holds a long one.
    max_request_bytes: int = Field(default=2_000_000, ge=1024, le=100_000_000)
    # GET /metrics/engine: the engine's queue, KV-block and prefix-cache counters to any valid key.
    # Cache counters tell when other users' requests shared KV: enable only where every key holder
    # is trusted (operators, tests).
    expose_engine_metrics: bool = False
    # Proxy keys (`rag keys create --proxy`): the request headers that name the end user, first
    # present wins; the user must be registered, and the groups always come from the directory.
    proxy_user_headers: list[str] = Field(
        default=["X-OpenWebUI-User-Email", "X-OpenWebUI-User-Name", "X-Forwarded-User"])
    # The audit log (HOME/audit.jsonl) keeps a SHA-256 of each question; true keeps the text too.
    audit_questions: bool = False
    # GET /metrics (Prometheus, no key): request counts, latencies, engine and admission gauges, no
    # text or names. Do not expose it publicly (cache counters are totals over all users): bind it
    # to the monitoring network or turn it off.
    metrics_enabled: bool = True
    # Service logs: "text", or "json" (one object per line, with the request id).
    log_format: Literal["text", "json"] = "text"

    @field_validator("collection")
    @classmethod
    def _check_collection(cls, v: str) -> str:
        check_collection_name(v)
        return v

    @model_validator(mode="after")
    def _check_hnsw(self) -> Settings:
        if self.pg_hnsw_ef_construction < 2 * self.pg_hnsw_m:
            raise ValueError(f"pg_hnsw_ef_construction must be at least 2 x pg_hnsw_m = {2 * self.pg_hnsw_m} "
                             f"(pgvector refuses less), got {self.pg_hnsw_ef_construction}")
        return self

    def generator_key(self) -> str | None:
        """The remote generator's key: generator_api_key, else the first line of generator_api_key_file.

        Raises:
            ConfigError: the key file is unreadable or empty.
        """
        if self.generator_api_key is not None:
            return self.generator_api_key.get_secret_value()
        if self.generator_api_key_file is None:
            return None
        try:
            key = self.generator_api_key_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read generator_api_key_file {self.generator_api_key_file}: {e.strerror}") from e
        if not key:
            raise ConfigError(f"generator_api_key_file {self.generator_api_key_file} is empty")
        warn_if_readable_by_others(self.generator_api_key_file, "generator_api_key_file")
        return key

    @property
    def catalog_path(self) -> Path:
        return self.home / "catalog.sqlite"

    @property
    def index_dir(self) -> Path:
        return self.home / "indexes"

    @property
    def model_cache(self) -> Path:
        return self.home / "models"


def warn_if_readable_by_others(path: Path, what: str) -> None:
    """Warn loudly about a key file that other users may read (we read it; its mode is the owner's call)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        logging.getLogger("rag.settings").warning(
            "%s %s is readable by other users (mode %s): anyone on this machine can use the key. "
            "Run `chmod 600 %s`.", what, path, stat.filemode(mode), path)


def check_collection_name(name: str) -> str:
    """Collection names become file names: keep them simple."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name or ""):
        raise ConfigError(
            f"invalid collection name {name!r}: use 1-64 letters, digits, '_', '-' or '.'"
        )
    return name


# ingest_workers="auto" starts a parse pool only with this many CPUs or more (see ingest_worker_count).
AUTO_POOL_MIN_CPUS = 4


def ingest_worker_count(configured: int | Literal["auto"]) -> int:
    """Parse processes for `rag ingest`: `configured`, or for "auto" one fewer than the CPUs this process may use.

    "auto" counts the CPUs in this process's affinity mask (what Slurm, taskset or a cgroup cpuset
    gave it, not the machine's cores), capped by SLURM_CPUS_PER_TASK when set (a job step may see
    more CPUs than its task was allocated), and leaves one to the ingest process itself (chunking,
    embedding, writing). Below AUTO_POOL_MIN_CPUS it parses in process: on 2 shared cores two
    workers parsed 0.6x as fast as one (each spawned worker imports the parsers for seconds;
    docs/benchmarks.md). 1 parses in process.
    """
    if configured != "auto":
        return configured
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) >= 1:
        cpus = min(cpus, int(slurm))
    return cpus - 1 if cpus >= AUTO_POOL_MIN_CPUS else 1


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from the TOML file, RAG_* variables and explicit overrides (highest).

    Raises:
        ConfigError: the TOML file is unreadable or a value is invalid.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    home = Path(overrides.get("home") or os.environ.get("RAG_HOME") or ".rag")
    config_file = Path(os.environ.get("RAG_CONFIG") or home / "rag.toml")
    file_values: dict[str, Any] = {}
    if config_file.is_file():
        try:
            file_values = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read settings file {config_file}: {e}") from e
    elif os.environ.get("RAG_CONFIG"):
        raise ConfigError(f"RAG_CONFIG points at {config_file}, which does not exist")
    # pydantic-settings gives init kwargs priority over env; we want env over file, so
    # drop file values that the environment sets.
    for key in list(file_values):
        if f"RAG_{key.upper()}" in os.environ:
            del file_values[key]
    try:
        return Settings(**{**file_values, **overrides})
    except ValueError as e:
        raise ConfigError(f"invalid settings: {_short_validation_error(e)}") from e


def _short_validation_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        # A check across fields (a model validator) has no location; its message names the fields.
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else
            err["msg"].removeprefix("Value error, ") for err in errors()
        )
    return str(e)
