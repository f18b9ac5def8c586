"""bench/filtered_search.py --cache: a run in two calls (build, then search from what was kept)
measures what one run measures: the same data, the same index, the same recall."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--n", "40000", "--stores", "faiss-ivf", "--no-pg", "--queries", "12", "--topics", "50"]


def _run(*extra: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "filtered_search.py"), *COMMON, *extra],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _recalls(text: str) -> list[tuple[str, str, str]]:
    """(store, share, recall) of each table row: latencies differ from run to run, these may not."""
    return [tuple(c.strip() for c in line.split("|")[1:4]) for line in text.splitlines() if line.startswith("| ")
            and not line.startswith("| store")]


def test_a_cached_run_in_two_calls_measures_what_one_run_measures(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    built = _run("--cache", str(cache), "--build-only")
    assert "faiss-ivf built in" in built and "|" not in built  # stopped before searching
    # each phase's wall time, so a run cut short by a time limit still says where its time went
    for phase in ("data", "data save", "faiss-ivf build", "faiss-ivf save"):
        assert f"# phase {phase}: " in built
    assert all(f" {step} " in built for step in ("train", "fill", "calibrate"))
    assert {p.name for p in cache.iterdir()} >= {"vecs.npy", "doc_group.npy", "queries.npy", "data.json", "ivf.npz"}
    searched = _run("--cache", str(cache))
    assert "faiss-ivf loaded from" in searched and "data read from" in searched
    assert "# phase faiss-ivf load: " in searched and "# phase exact truth: " in searched
    rows = _recalls(searched)
    assert any("approximate" in store for store, share, _ in rows if share == "50%")  # the lists were searched
    # As a run that made everything itself: the same rows, the exact peer's recall exactly, and the
    # index's within rounding of a k-means trained anew (Faiss's threads may sum in another order).
    fresh = _recalls(_run())
    assert [(store.split(" (")[0], share) for store, share, _ in rows] == \
        [(store.split(" (")[0], share) for store, share, _ in fresh]
    for (store, _, got), (_, _, want) in zip(rows, fresh, strict=True):
        assert (got == want) if store.startswith("exact") else abs(float(got) - float(want)) <= 0.02
