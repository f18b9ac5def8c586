"""Heaviest test files first, so two workers finish together (longest-processing-time order).

xdist's `--dist loadfile` hands each worker the next file in collection order as it frees up; in
the alphabetical order the slowest files (a minute or more: Slurm, the README's Python block, the
schema fuzzer) could start last and leave one worker running alone. `tests/file_seconds.json`
holds each file's seconds from a full run (regenerate it with `scripts/test_file_seconds.py`
from a run's `--junitxml`); a file it does not know counts as `UNKNOWN_SECONDS`. Order inside a
file is kept, and only the order of files changes, so module fixtures see what they always saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).resolve().parent / "file_seconds.json"
UNKNOWN_SECONDS = 5.0


def file_seconds() -> dict[str, float]:
    """{test file relative to the repository: seconds}, empty when the file is missing or broken."""
    try:
        return {str(k): float(v) for k, v in json.loads(SECONDS_FILE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def heaviest_files_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """Items grouped by file, files by descending seconds (ties: as collected), items as collected."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

    def key(pair: tuple[int, pytest.Item]) -> tuple[float, int, int]:
        index, item = pair
        file = item.nodeid.split("::", 1)[0]
        return -seconds.get(file, UNKNOWN_SECONDS), first_seen[file], index

    return [item for _, item in sorted(enumerate(items), key=key)]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":
        items[:] = heaviest_files_first(items, file_seconds())
