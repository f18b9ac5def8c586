"""Quiet libraries: no third-party progress bars or chatter from the Python API, our own progress only.

The end-to-end tests run a script that uses `Rag` the way a notebook or a script does (ingest,
then a query with generation, all models real, the generator converted from GGUF) in a real
subprocess, and read everything it wrote.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from rich.console import Console

from rag import quiet
from rag.progress import IngestProgress, show_progress
from rag.quiet import GGUF_CONVERTER, quiet_libraries

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LAB_DOCS = REPO / "examples" / "lab-docs"
OUR_BAR = re.compile(r"\b(documents|embedding) .*\d+(/\d+)? (docs|chunks)")  # rag/progress.py's columns
THIRD_PARTY_BAR_TEXT = ("Loading weights", "it/s]", "s/it]", "%|", "de-quantizing", "Writing model shards")

# The user's own transformers settings, all unlike the defaults, which must survive our calls.
SCRIPT = textwrap.dedent('''
    import importlib, json, sys
    from pathlib import Path

    import transformers
    from transformers.utils import logging as hf_logging

    from rag.pipeline import Rag
    from rag.settings import load_settings

    home, docs = Path(sys.argv[1]), Path(sys.argv[2])
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the package attribute is the class
    hf_logging.set_verbosity_info()
    hf_logging.disable_progress_bar()
    hub_tqdm.enable_progress_bars("huggingface_hub.lfs_upload")
    before = [hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), dict(hub_tqdm.progress_bar_states)]

    rag = Rag(load_settings(home=home, max_new_tokens=8))
    report = rag.ingest([docs])
    rag.identity.add_user("alice", ["genomics"])
    answer = rag.query("Which GPU nodes can I use?", rag.principal("alice"))
    folder = rag.embedder.folder
    rag.close()
    after = [hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), dict(hub_tqdm.progress_bar_states)]
    print(json.dumps({"ok": report.ok, "answered": bool(answer.text), "before": before, "after": after}))
    sys.stdout.flush()
    # The user's INFO level still works for their own transformers calls.
    print("USER-CALL-STARTS", file=sys.stderr, flush=True)
    transformers.AutoConfig.from_pretrained(folder)
''')


def _env() -> dict[str, str]:
    # What the CLI sets would hide the library's own bars, so the script runs without it.
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return env | {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
                  "PYTHONPATH": str(REPO)}


def _setup(tmp: Path, name: str, model_cache: Path) -> tuple[Path, Path, Path]:
    home, docs, script = tmp / name / "home", tmp / name / "docs", tmp / "script.py"
    home.mkdir(parents=True, mode=0o700)
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    docs.mkdir(parents=True)
    (docs / "gpus.md").write_text("# GPU nodes\n\nThe gpu-a100 nodes are open to the genomics group.\n")
    (docs / ".rag-acl.toml").write_text('allow = ["group:genomics"]\n')
    script.write_text(SCRIPT)
    return home, docs, script


@pytest.fixture(scope="module")
def fresh_models(tmp_path_factory) -> Path:
    """An empty model cache, so the first run converts the reranker (ONNX) and generator (GGUF)."""
    return tmp_path_factory.mktemp("quiet-models")


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory, fresh_models) -> subprocess.CompletedProcess:
    home, docs, script = _setup(tmp_path_factory.mktemp("quiet"), "piped", fresh_models)
    return subprocess.run([sys.executable, str(script), str(home), str(docs)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def _api_output(run: subprocess.CompletedProcess) -> str:
    """What the script printed before its own transformers call."""
    return run.stderr.split("USER-CALL-STARTS")[0] + run.stdout


def test_api_shows_no_third_party_bars(piped_run):
    assert piped_run.returncode == 0, piped_run.stderr[-3000:]
    ours = _api_output(piped_run)
    for text in THIRD_PARTY_BAR_TEXT:
        assert text not in ours, f"{text!r} in the output of the API:\n{ours[-3000:]}"
    # Not a terminal: none of our bars either.
    assert "loading models" not in ours and not OUR_BAR.search(ours)


def test_api_logs_nothing_through_transformers_at_the_users_info_level(piped_run):
    assert piped_run.returncode == 0, piped_run.stderr[-3000:]
    assert "[transformers]" not in _api_output(piped_run), _api_output(piped_run)[-3000:]


def test_api_leaves_the_users_transformers_settings_as_they_were(piped_run):
    assert piped_run.returncode == 0, piped_run.stderr[-3000:]
    result = json.loads(piped_run.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["answered"]
    assert result["before"][:2] == [logging.INFO, False]
    assert result["after"] == result["before"]
    # ... and they still work: the user's own call after ours logs at INFO as they asked.
    assert "loading configuration file" in piped_run.stderr.split("USER-CALL-STARTS")[1]


def test_a_terminal_gets_our_bars_and_no_one_elses(tmp_path, fresh_models, piped_run):
    """With stderr on a terminal, `Rag.ingest()` draws our bars by default; still no third-party ones."""
    home, docs, script = _setup(tmp_path, "tty", fresh_models)
    main, child = pty.openpty()
    process = subprocess.Popen([sys.executable, str(script), str(home), str(docs)], env=_env(), cwd=REPO,
                               stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 300)
        if not ready:
            process.kill()
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert process.wait(timeout=60) == 0
    seen = b"".join(chunks).decode(errors="replace").split("USER-CALL-STARTS")[0]
    assert OUR_BAR.search(seen), seen[-3000:]
    for text in THIRD_PARTY_BAR_TEXT:
        assert text not in seen, f"{text!r} on the terminal:\n{seen[-3000:]}"


# -- quiet_libraries itself -------------------------------------------------------------------

@pytest.fixture
def users_settings():
    """Puts back whatever transformers settings a test changes."""
    from huggingface_hub.utils import tqdm as _unused  # noqa: F401 - makes sure the module is loaded
    from transformers.utils import logging as hf_logging

    hub_states = sys.modules["huggingface_hub.utils.tqdm"].progress_bar_states
    saved = (logging.getLogger("transformers").level, hf_logging.is_progress_bar_enabled(), dict(hub_states))
    yield hf_logging, hub_states
    logging.getLogger("transformers").setLevel(saved[0])
    hf_logging._tqdm_active = saved[1]
    hub_states.clear()
    hub_states.update(saved[2])


@pytest.mark.parametrize("verbosity", [logging.INFO, logging.WARNING])
@pytest.mark.parametrize("bars", [True, False])
def test_quiet_restores_exactly_what_it_found(users_settings, verbosity, bars):
    hf_logging, hub_states = users_settings
    hf_logging.set_verbosity(verbosity)
    hf_logging._tqdm_active = bars
    hub_states.clear()
    hub_states.update({"_global": bars, "huggingface_hub.http_get": not bars})
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), dict(hub_states))
    with quiet_libraries():
        assert hf_logging.get_verbosity() == logging.ERROR
        assert not hf_logging.is_progress_bar_enabled()
        assert all(not enabled for enabled in hub_states.values())
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), dict(hub_states)) == before


def test_quiet_holds_until_the_last_of_overlapping_loads_ends(users_settings):
    """Loads in two threads overlap (API queries load models lazily): the first to end must not unmute the other."""
    hf_logging, _ = users_settings
    hf_logging.set_verbosity_info()
    first_inside, second_done = threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with quiet_libraries():
            first_inside.set()
            second_done.wait(10)
            seen.append(hf_logging.is_progress_bar_enabled())

    thread = threading.Thread(target=first)
    thread.start()
    first_inside.wait(10)
    with quiet_libraries():
        pass
    second_done.set()
    thread.join(10)
    assert seen == [False]
    assert hf_logging.get_verbosity() == logging.INFO and hf_logging.is_progress_bar_enabled()


def test_quiet_silences_and_restores_the_gguf_converters_own_tqdm():
    module = pytest.importorskip(GGUF_CONVERTER)
    original = module.tqdm
    with quiet_libraries(tqdm_modules=(GGUF_CONVERTER,)):
        out = io.StringIO()
        for _ in module.tqdm(range(3), file=out, desc="Converting"):
            pass
        assert out.getvalue() == ""
    assert module.tqdm is original and not quiet._patched_tqdm


# -- our own progress ---------------------------------------------------------------------------

def test_progress_is_on_for_terminals_and_notebooks_only():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert not show_progress(None, Console(file=io.StringIO()))
    assert show_progress(None, Console(file=Tty()))
    assert show_progress(None, Console(file=io.StringIO(), force_jupyter=True))
    assert show_progress(True, Console(file=io.StringIO())) and not show_progress(False, Console(file=Tty()))


def test_a_notebook_without_ipywidgets_gets_one_line_per_stage(monkeypatch):
    """rich cannot redraw a cell without ipywidgets: summaries at the end instead of a silent bar."""
    pytest.importorskip("rich.jupyter")
    monkeypatch.setattr("rag.progress._has_ipywidgets", lambda: False)
    shown: list[str] = []
    # IPython is not installed here; this stands in for the notebook's display().
    monkeypatch.setattr("rich.jupyter.display", lambda segments, text: shown.append(text))
    console = Console(file=io.StringIO(), force_jupyter=True)
    with IngestProgress(enabled=True, console=console) as bar:
        bar.update("ingest", 1, 2)
        bar.update("embed", 5, 0)
        bar.update("ingest", 2, 2)
    text = "".join(shown)
    assert "ipywidgets" in text
    assert "documents: 2/2 docs in" in text and "embedding: 5 chunks in" in text
    assert "loading models" not in text
