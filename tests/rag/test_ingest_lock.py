"""One ingest per collection at a time: a second waits for the first, and nothing either wrote is lost."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from rag.ingest_lock import exclusive_ingest

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys; from pathlib import Path; from rag.ingest_lock import exclusive_ingest\n"
        "with exclusive_ingest(Path(sys.argv[1]), 'x'):\n"
        "    print('held', flush=True); sys.stdin.readline()\n")


def _notes(root: Path, prefix: str, n: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        text = f"# {prefix} note {i}\n\nThe {prefix} sample {i} was stored at -{i} C.\n"
        (root / f"{prefix}-{i}.md").write_text(text)
    return root


def test_a_second_ingest_waits_for_the_holder_then_keeps_both(tmp_path, rag_factory, caplog):
    rag = rag_factory(tmp_path / "home")
    rag.ingest([_notes(tmp_path / "first", "alpha", 3)])  # creates the collection and its staging folder
    lock = tmp_path / "home" / "staging" / "default.sqlite.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # another process's ingest, mid-run
    try:
        assert holder.stdout.readline().strip() == "held"
        reports: list = []
        caplog.set_level(logging.WARNING, logger="rag.ingest_lock")
        second = threading.Thread(target=lambda: reports.append(rag.ingest([_notes(tmp_path / "b", "beta", 2)])))
        second.start()
        deadline = time.monotonic() + 120
        while "waiting for it to finish" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "another ingest is writing collection 'default'" in caplog.text
        assert second.is_alive() and not reports  # it waits: nothing written beside the holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    second.join(timeout=300)
    assert reports and reports[0].ok
    store = rag.collection()
    store.refresh()
    assert store.stats()["documents"] == 5


def test_the_lock_is_released_and_its_file_owner_only(tmp_path):
    lock = tmp_path / "x.lock"
    with exclusive_ingest(lock, "x"):
        pass
    with exclusive_ingest(lock, "x"):  # released: taken again at once
        assert lock.stat().st_mode & 0o777 == 0o600
