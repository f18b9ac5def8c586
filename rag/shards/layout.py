"""Where Faiss shards of a sharded ingest live, and the record each one keeps of its run.

Shard I of N of a collection is a data directory of its own,
`<home>/shards/<collection>/<I>-of-<N>/` (catalog.sqlite, indexes/, shard.json), so N jobs on
N nodes never write the same SQLite file. `shard.json` says what the shard was built from and
whether its last run finished; `rag index merge` trusts a shard only when it says "complete".
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rag.private_files import open_private

RECORD_NAME = "shard.json"
MERGED_NAME = "merged.json"
_DIR_RE = re.compile(r"(\d+)-of-(\d+)")

# States of a shard's run, in order. A run killed while "ingesting" is resumed as it is by the
# next run; one that was "syncing" or "complete" starts from the main collection again.
SYNCING, INGESTING, COMPLETE = "syncing", "ingesting", "complete"


@dataclass
class ShardRecord:
    """What one shard was built from, and how far its last run got."""

    collection: str
    shard: int
    num_shards: int
    paths: list[str]  # resolved roots the run walked, in order
    embedder: str
    fingerprint: str
    dim: int
    chunking: dict
    run_id: str  # new for every run that starts afresh; the merge remembers which runs it merged
    state: str = SYNCING
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    report: dict | None = None

    @property
    def is_complete(self) -> bool:
        return self.state == COMPLETE

    def builds_like(self, other: ShardRecord) -> bool:
        """Same embedder and chunking: vectors and chunks of the two are interchangeable."""
        return (self.fingerprint, self.dim, self.chunking) == (other.fingerprint, other.dim, other.chunking)


def shards_root(home: Path, collection: str) -> Path:
    return home / "shards" / collection


def shard_dir(home: Path, collection: str, shard: int, num_shards: int) -> Path:
    return shards_root(home, collection) / f"{shard}-of-{num_shards}"


def find_shard_dirs(home: Path, collection: str) -> dict[int, dict[int, Path]]:
    """The shard directories of a collection by shard count, then shard index."""
    found: dict[int, dict[int, Path]] = {}
    root = shards_root(home, collection)
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        m = _DIR_RE.fullmatch(entry.name)
        if m and entry.is_dir():
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = entry
    return found


def read_record(directory: Path) -> ShardRecord | None:
    """The shard's record, or None when it has none or it does not parse (never complete then)."""
    try:
        data = json.loads((directory / RECORD_NAME).read_text())
        data.pop("complete", None)
        return ShardRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_record(directory: Path, record: ShardRecord) -> None:
    """Replace the record in one step, so a job killed while writing leaves the old one."""
    data = asdict(record) | {"complete": record.is_complete}  # for people reading the file
    write_json(directory / RECORD_NAME, data)


def read_merged(home: Path, collection: str) -> dict | None:
    """What the last successful merge took: {"num_shards", "run_ids": {"I": run_id}, "merged_at"}."""
    try:
        return json.loads((shards_root(home, collection) / MERGED_NAME).read_text())
    except (OSError, ValueError):
        return None


def write_merged(home: Path, collection: str, records: dict[int, ShardRecord]) -> None:
    write_json(shards_root(home, collection) / MERGED_NAME, {
        "num_shards": next(iter(records.values())).num_shards,
        "run_ids": {str(i): r.run_id for i, r in sorted(records.items())},
        "merged_at": time.time(),
    })


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open_private(tmp) as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())  # a preempted job must not leave a "complete" that is not on disk
    os.replace(tmp, path)
