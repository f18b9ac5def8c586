"""The embedder with its model in a worker process (`EmbedderConfig.in_worker`, ingest's
`ingest_embed_process`): same vectors, no model in this process, clear errors when the worker fails.

On a GPU node this keeps the embedder's launches clear of the GIL of the ingest's reading,
chunking and writing; here (CPU) the same machinery runs with a CPU worker.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from ingest.embed.embedder import Embedder, EmbedderConfig, default_embedder_path
from rag.errors import ModelError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("without_forward_memo")]  # each spawns a process: seconds

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [f"note {i}: the buffer recipe for imaging run {i}, " + "with more words " * (i % 9) for i in range(300)]


def test_worker_embedder_gives_this_process_s_vectors_without_loading_the_model(embedder: Embedder) -> None:
    worker = Embedder(EmbedderConfig(device="cpu", in_worker=True))
    try:
        assert worker.model is None and worker.runner is None  # only the tokenizer and config here
        assert not worker.launches_here and embedder.launches_here
        assert (worker.dim, worker.max_length, worker.fingerprint) == (
            embedder.dim, embedder.max_length, embedder.fingerprint)
        np.testing.assert_allclose(worker.embed(TEXTS), embedder.embed(TEXTS), atol=1e-5)
        np.testing.assert_allclose(worker.embed_query("imaging buffer"), embedder.embed_query("imaging buffer"),
                                   atol=1e-5)
        assert worker.embed([]).shape == (0, embedder.dim)
        process = worker._workers._procs[0]
        worker.close()
        assert not process.is_alive()
        # A call after close starts a worker again rather than failing.
        np.testing.assert_allclose(worker.embed(TEXTS[:3]), embedder.embed(TEXTS[:3]), atol=1e-5)
        # A worker that dies is the embedder's error, not a hang.
        worker._workers._procs[0].kill()
        worker._workers._procs[0].join(10)
        with pytest.raises(ModelError, match="died"):
            worker.embed(TEXTS[:5])
    finally:
        worker.close()


def test_weights_that_do_not_load_are_a_model_error_at_the_first_call(tmp_path: Path) -> None:
    # The tokenizer and config load here; the weights only in the worker, whose failure must
    # surface as the embedder's error, not a hang or a bare EOFError.
    folder = tmp_path / "broken"
    shutil.copytree(default_embedder_path(), folder)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    worker = Embedder(EmbedderConfig(model=folder, device="cpu", in_worker=True))
    try:
        with pytest.raises(ModelError, match="failed to start"):
            worker.embed(["a"])
    finally:
        worker.close()


def test_ingest_with_the_embedder_in_its_own_process_writes_the_same_rows(tmp_path: Path) -> None:
    from rag.pipeline import Rag
    from rag.settings import Settings

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.md").write_text(f"# Protocol {i}\n\n" + f"Step {i}: mix the buffer and image it. " * 40)
    (corpus / ".rag-acl.toml").write_text('allow = ["group:imaging"]\n')
    dumps = []
    default_switch = sys.getswitchinterval()
    for in_worker in (False, True):
        rag = Rag(Settings(home=tmp_path / f"home-{in_worker}", device="cpu", ingest_embed_process=in_worker,
                           ingest_batch_chunks=7))  # several embed calls, documents across them
        switch: list[float] = []
        rag.load_ingest_embedder()  # what ingest does first (else `rag.embedder` builds the query embedder)
        embed = rag.embedder.embed

        def spy(texts, embed=embed, switch=switch):
            switch.append(sys.getswitchinterval())
            return embed(texts)

        rag.embedder.embed = spy  # type: ignore[method-assign]
        try:
            report = rag.ingest([corpus])
            # Quick GIL hand-overs only where this process launches the model's kernels.
            expected = default_switch if in_worker else 1e-4
            assert switch and all(abs(x - expected) < 1e-7 for x in switch), (in_worker, switch)
            assert report.added == 6 and not report.problems
            assert (rag.embedder.model is None) == in_worker
            # The worker's own embedding time is reported beside the calls' round trips.
            assert ("embed_in_worker" in report.seconds) == in_worker
            if in_worker:
                assert 0 < report.seconds["embed_in_worker"] <= report.seconds["embed"] + 0.05
            dumps.append(rag.catalog.dump(rag.collection().name))
        finally:
            rag.close()
    plain, worker = dumps
    assert [{k: v for k, v in r.items() if k != "vector"} for r in plain] == \
        [{k: v for k, v in r.items() if k != "vector"} for r in worker]
    np.testing.assert_allclose(np.stack([r["vector"] for r in worker]), np.stack([r["vector"] for r in plain]),
                               atol=1e-5)


def test_by_default_ingest_keeps_a_cpu_embedder_in_process(tmp_path: Path) -> None:
    from rag.pipeline import Rag
    from rag.settings import Settings

    rag = Rag(Settings(home=tmp_path / "home", device="cpu"))
    try:
        rag.load_ingest_embedder()
        assert rag.embedder.model is not None and rag.embedder._workers is None
    finally:
        rag.close()


def test_a_script_without_a_main_guard_still_embeds_in_its_own_process(tmp_path: Path, embedder: Embedder) -> None:
    # Spawned children run the main module again; a script that embeds at import time cannot start
    # a worker (its child would start one in turn). The embedder then loads the model here and
    # says why, rather than failing a run that worked before workers existed.
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "v.npy"
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import numpy as np\n"
        "from ingest.embed.embedder import Embedder, EmbedderConfig\n"
        "e = Embedder(EmbedderConfig(device='cpu', in_worker=True))\n"
        f"np.save({str(out)!r}, e.embed(['a text about buffers', 'imaging notes']))\n"
        "print('model here:', e.model is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model here: True" in run.stdout
    assert "embedding in this process instead" in run.stderr and '__name__ == "__main__"' in run.stderr
    np.testing.assert_allclose(np.load(out), embedder.embed(["a text about buffers", "imaging notes"]), atol=1e-5)
