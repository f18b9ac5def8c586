"""Walk the corpus: files under the given paths and JSONL records, each with its ACL and hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.source_names import SourceNamer
from permissions.models import make_acl
from permissions.sources import AclResolver
from rag.errors import ConfigError, RagError

SUPPORTED_SUFFIXES = {".md", ".markdown", ".txt", ".html", ".htm", ".pdf", ".docx", ".jsonl"}
RECORD_KEYS = {"id", "text", "title", "acl", "metadata"}


@dataclass(frozen=True)
class SourceItem:
    """One source to ingest: a file, or one record of a JSONL file."""

    key: str  # absolute resolved path for files; f"{abs_path}#{record_id}" for JSONL records
    path: Path  # the file (the .jsonl file for records), absolute and resolved
    kind: str  # "file" | "record"
    content_hash: str  # sha256 hex of the file bytes; for a record, of (text, title, metadata)
    acl: frozenset[str]
    acl_origin: str  # "posix", "sidecar:/abs/.rag-acl.toml[#ruleN]", "record" or "error"
    title: str | None = None  # records only
    text: str | None = None  # records only (files are parsed later)
    metadata: dict[str, Any] = field(default_factory=dict)
    # Why the ACL could not be determined; then `acl` is empty (nobody) until that is fixed.
    acl_error: str | None = None
    # What citations call it: its path under the ingest root or a configured URL, never the
    # absolute server path (ingest/source_names.py); "" for items made by hand.
    display: str = ""


# What stored documents a SourceProblem speaks for (they are kept, never deleted, meanwhile):
COVERS_SOURCE = "source"  # the document with the problem's key, if stored
COVERS_RECORDS = "records"  # the stored records of the JSONL file `path` that the walk did not yield
COVERS_TREE = "tree"  # the stored documents at or under `path` that the walk did not yield
COVERS_AGAIN = "again"  # the document `key`, yielded earlier in this walk: which source is meant is unknown


@dataclass(frozen=True)
class SourceProblem:
    """A source that cannot be ingested, with a one-line human reason.

    The stored documents it covers stay, with `acl` if it is known, else readable by nobody:
    a source that could not be read may have had its ACL narrowed meanwhile.
    """

    key: str  # the item's key, f"{abs_path}:{lineno}" for a bad JSONL line, or a directory
    path: Path
    reason: str
    acl: frozenset[str] | None = None  # the source's current ACL; None: it cannot be determined
    covers: str = COVERS_SOURCE


def scan_roots(paths: Sequence[Path | str]) -> list[Path]:
    """Check and resolve the paths to ingest, keeping their order and dropping repeats.

    Raises:
        ConfigError: no path given, or a path does not exist.
    """
    if not paths:
        raise ConfigError("no paths given: name at least one file or directory to ingest")
    roots: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise ConfigError(f"path not found: {path}")
        resolved = path.resolve()
        if resolved not in roots:
            roots.append(resolved)
    return roots


def is_under(key: str, root: Path) -> bool:
    """Whether a document key (a path, or PATH#RECORD) is `root` or lies below it."""
    path = key.split("#", 1)[0]
    r = str(root)
    return path == r or path.startswith(r.rstrip(os.sep) + os.sep)


def is_under_any(key: str, roots: Sequence[Path]) -> bool:
    """Whether a document key lies at or under one of `roots` (the paths an ingest walked)."""
    return any(is_under(key, root) for root in roots)


def walk_sources(
    paths: Sequence[Path | str], follow_symlinks: bool = False, namer: SourceNamer | None = None
) -> Iterator[SourceItem | SourceProblem]:
    """Yield every supported source under `paths`, in a deterministic (sorted) order.

    Directories are walked recursively, skipping dotfiles and dot-directories (so sidecar
    ACL files are never ingested) and, silently, files of unsupported types. A file named
    in `paths` with an unsupported type is reported as a SourceProblem. Symbolic links are
    skipped unless `follow_symlinks`; a file reached twice is yielded once.

    The walk is lazy and reads one file at a time (JSONL files line by line), so a corpus of
    any size is never held in memory; what it keeps is the set of keys already yielded.

    Raises:
        ConfigError: at call time (not on first iteration) when a path does not exist.
    """
    roots = scan_roots(paths)  # eager: a typo in a path fails before anything is read
    return _Walker(follow_symlinks, namer or SourceNamer()).walk(roots)


def count_sources(paths: Sequence[Path | str], follow_symlinks: bool = False) -> int:
    """How many items `walk_sources` will yield, without hashing files or parsing records.

    The same directory walk, counting each file as one item and each non-blank line of a
    JSONL file as one (read in blocks, kept nowhere): a cheap first pass that gives a
    progress bar its total. Files that change in between make it an estimate.
    """
    total = 0
    for found in _Walker(follow_symlinks).candidates(scan_roots(paths)):
        if isinstance(found, _Candidate) and found.path.suffix.lower() == ".jsonl":
            total += _count_lines(found.path.resolve())
        else:
            total += 1
    return total


@dataclass(frozen=True)
class _Candidate:
    """A file the walk will read: where it is, how its ACL resolves, whether it was named."""

    path: Path
    resolver: AclResolver
    explicit: bool


class _Walker:
    """One walk over a list of roots: remembers what it has yielded and where it has been."""

    def __init__(self, follow_symlinks: bool, namer: SourceNamer | None = None) -> None:
        self.follow_symlinks = follow_symlinks
        self.namer = namer or SourceNamer()
        self._seen_keys: set[str] = set()
        self._seen_dirs: set[Path] = set()

    def walk(self, roots: list[Path]) -> Iterator[SourceItem | SourceProblem]:
        for found in self.candidates(roots):
            if isinstance(found, SourceProblem):
                yield found
            else:
                yield from self._file(found)

    def candidates(self, roots: list[Path]) -> Iterator[_Candidate | SourceProblem]:
        """The files to read, in walk order, each once; nothing is opened here."""
        for root in roots:
            resolver = AclResolver(root)
            if root.is_dir():
                yield from self._walk_dir(root, resolver)
            else:
                yield from self._candidate(root, resolver, explicit=True)

    def _walk_dir(self, d: Path, resolver: AclResolver) -> Iterator[_Candidate | SourceProblem]:
        real = d.resolve()
        if real in self._seen_dirs:  # a symlink loop, or overlapping roots
            return
        self._seen_dirs.add(real)
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            # What is below is unknown, not gone (a stale NFS handle, a chmod): keep it, unreadable.
            yield SourceProblem(str(d), d, f"cannot list directory: {e.strerror or e}",
                                covers=COVERS_TREE)
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            try:
                if entry.is_symlink() and not self.follow_symlinks:
                    continue
                if entry.is_dir(follow_symlinks=self.follow_symlinks):
                    yield from self._walk_dir(path, resolver)
                elif entry.is_file(follow_symlinks=self.follow_symlinks):
                    yield from self._candidate(path, resolver, explicit=False)
                # else: sockets, FIFOs (reading one would block), devices, broken links
            except OSError as e:
                yield SourceProblem(str(path), path, f"cannot read: {e.strerror or e}",
                                    covers=COVERS_TREE)

    def _candidate(self, path: Path, resolver: AclResolver, explicit: bool
                   ) -> Iterator[_Candidate | SourceProblem]:
        suffix = path.suffix.lower()
        real = path.resolve()
        key = str(real)
        if suffix not in SUPPORTED_SUFFIXES:
            if explicit:
                what = suffix or "(no suffix)"
                yield SourceProblem(key, real, f"unsupported file type {what}; supported: "
                                               f"{', '.join(sorted(SUPPORTED_SUFFIXES))}")
            return
        if key in self._seen_keys:
            return
        self._seen_keys.add(key)
        yield _Candidate(path, resolver, explicit)

    def _file(self, found: _Candidate) -> Iterator[SourceItem | SourceProblem]:
        path, resolver = found.path, found.resolver
        real = path.resolve()
        key = str(real)
        if found.explicit and not real.is_file():
            yield SourceProblem(key, real, "not a regular file")
            return
        display = self.namer.name(path, resolver.root)
        if path.suffix.lower() == ".jsonl":
            yield from _records(path, real, resolver, display)
            return
        # The ACL first: a file we may not read can still have had its ACL narrowed.
        acl_or_error = _file_acl(resolver, path)
        try:
            with real.open("rb") as f:
                content_hash = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            known = None if isinstance(acl_or_error, str) else acl_or_error[0]
            yield SourceProblem(key, real, f"cannot read file: {e.strerror or e}", acl=known)
            return
        yield _with_acl(SourceItem(key=key, path=real, kind="file", content_hash=content_hash,
                                   acl=frozenset(), acl_origin="", display=display), acl_or_error)


def _with_acl(item: SourceItem, acl_or_error: tuple[frozenset[str], str] | str) -> SourceItem:
    """The item with its ACL, or, when that cannot be determined, readable by nobody and why."""
    if isinstance(acl_or_error, str):
        return dataclasses.replace(item, acl=frozenset(), acl_origin="error", acl_error=acl_or_error)
    acl, origin = acl_or_error
    return dataclasses.replace(item, acl=acl, acl_origin=origin)


def has_sources(root: Path, follow_symlinks: bool = False) -> bool:
    """Whether walking `root` finds anything at all (a source, or a problem to report).

    Reads no file and stops at the first find: a cheap test for an empty or unmounted root.
    """
    return next(iter(_Walker(follow_symlinks).candidates([root])), None) is not None


def _records(path: Path, real: Path, resolver: AclResolver, display: str = ""
             ) -> Iterator[SourceItem | SourceProblem]:
    """The records of one JSONL file; a bad line is reported and the others go on."""
    file_key = str(real)
    # The file's ACL is only needed by records without their own, and may be an error
    # (broken sidecar): resolve it once, lazily.
    file_acl: tuple[frozenset[str], str] | str | None = None
    first_line: dict[str, int] = {}  # record id -> line: the per-record state of a file
    for lineno, raw in _lines(real):
        if isinstance(raw, OSError):
            # The records not read yet are kept, readable by nobody, until the file reads again.
            yield SourceProblem(file_key, real, f"cannot read file: {raw.strerror or raw}",
                                covers=COVERS_RECORDS)
            return
        line_key = f"{file_key}:{lineno}"
        if isinstance(raw, _TooLong):
            # Which stored record it was is unknown (its id was never read): those not seen are held.
            yield SourceProblem(line_key, real, f"line {lineno}: {raw.size} bytes, over the limit for one "
                                f"JSONL line ({DEFAULT_MAX_LINE_BYTES} bytes): skipped unread",
                                covers=COVERS_RECORDS)
            continue
        if not raw.strip():
            continue
        try:
            record = _parse_record(raw, lineno)
        except _BadLine as e:
            if e.record_id is None:
                # Which stored record this line was is unknown: all those not seen are held.
                yield SourceProblem(line_key, real, str(e), covers=COVERS_RECORDS)
            else:
                yield SourceProblem(f"{file_key}#{e.record_id}", real, str(e))
            continue
        rid = record["id"]
        if rid in first_line:
            # Which line is meant is unknown (an appended correction?): the record is held for nobody.
            yield SourceProblem(f"{file_key}#{rid}", real, f"line {lineno}: duplicate id {rid!r} "
                                f"(first on line {first_line[rid]})", covers=COVERS_AGAIN)
            continue
        first_line[rid] = lineno
        key = f"{file_key}#{rid}"
        if record["acl_error"] is not None:
            acl_or_error: tuple[frozenset[str], str] | str = record["acl_error"]
        elif record["acl"] is not None:
            acl_or_error = record["acl"], "record"
        else:
            if file_acl is None:
                file_acl = _file_acl(resolver, path)
            acl_or_error = file_acl
        item = SourceItem(key=key, path=real, kind="record",
                          content_hash=_record_hash(record["text"], record["title"],
                                                    record["metadata"]),
                          acl=frozenset(), acl_origin="", title=record["title"],
                          text=record["text"], metadata=record["metadata"],
                          display=f"{display}#{rid}" if display else "")
        yield _with_acl(item, acl_or_error)


# A JSONL line is read whole before its record can be looked at, so without a bound one huge line
# (a dump with no newlines) would be held in memory. The default allows any record under the
# default max_document_bytes even with every character JSON-escaped (6 bytes each).
DEFAULT_MAX_LINE_BYTES = 6 * 100 * 1024 * 1024 + (1 << 20)


@dataclass(frozen=True)
class _TooLong:
    """A JSONL line over the limit: skipped to its newline, never held."""

    size: int  # bytes of the line (without its newline)


def _lines(path: Path, max_bytes: int = DEFAULT_MAX_LINE_BYTES
           ) -> Iterator[tuple[int, bytes | OSError | _TooLong]]:
    """(line number, line without its newline), a line at a time, none held past `max_bytes`.

    An OSError ends it; a longer line is read through in pieces and yielded as _TooLong.
    """
    try:
        with path.open("rb") as f:
            lineno = 0
            while True:
                raw = f.readline(max_bytes + 1)
                if not raw:
                    return
                lineno += 1
                if len(raw) > max_bytes and not raw.endswith(b"\n"):
                    size = len(raw)
                    while raw and not raw.endswith(b"\n"):  # skip the rest of the line, 1 MiB at a time
                        raw = f.readline(1 << 20)
                        size += len(raw)
                    yield lineno, _TooLong(size - raw.endswith(b"\n"))
                    continue
                yield lineno, raw[:-1] if raw.endswith(b"\n") else raw
    except OSError as e:
        yield 0, e


def _count_lines(path: Path) -> int:
    """Non-blank lines of a file, read a line at a time (1 when it cannot be read: one problem)."""
    n = 0
    for _, raw in _lines(path):
        if isinstance(raw, OSError):
            return max(n, 1)  # the walk reports it as one problem
        n += isinstance(raw, _TooLong) or bool(raw.strip())
    return n


class _BadLine(ValueError):
    """A JSONL line that cannot be used; `record_id` when the line still says which record it is."""

    def __init__(self, reason: str, record_id: str | None = None) -> None:
        super().__init__(reason)
        self.record_id = record_id


def _parse_record(raw: bytes, lineno: int) -> dict[str, Any]:
    """Check one JSONL line; raises _BadLine with a reason that names the line.

    A record whose only fault is its `acl` comes back with "acl_error" set: its text is
    fine, and it is stored readable by nobody until the ACL is fixed.
    """
    where = f"line {lineno}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(f"{where}: invalid UTF-8 at byte {e.start}") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int) or not str(rid).strip():
        raise _BadLine(f"{where}: missing or empty 'id' (a string or an integer)")
    rid = str(rid)
    # Unknown keys are refused rather than ignored: a misspelt "acl" would otherwise
    # silently give the record the file's (possibly wider) ACL.
    unknown = sorted(set(obj) - RECORD_KEYS)
    if unknown:
        raise _BadLine(f"{where}: unknown keys {unknown}; allowed: {sorted(RECORD_KEYS)} "
                       "(put other fields under 'metadata')", rid)
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise _BadLine(f"{where}: missing or empty 'text' (a non-empty string)", rid)
    title = obj.get("title")
    if title is not None and not isinstance(title, str):
        raise _BadLine(f"{where}: 'title' must be a string", rid)
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise _BadLine(f"{where}: 'metadata' must be a JSON object", rid)
    acl, acl_error = obj.get("acl"), None
    if "acl" in obj:  # present means the record asked for its own: "acl": null is no ACL either
        try:
            if not isinstance(acl, list):
                raise ConfigError("must be a list of entries like 'group:NAME'")
            acl = make_acl(acl)
        except ConfigError as e:
            # Not the file's ACL instead: the record asked for its own, likely a narrower one.
            acl, acl_error = None, f"{where}: bad 'acl': {e} (nobody may read the record until it is fixed)"
    return {"id": rid, "text": text, "title": title or None, "metadata": metadata,
            "acl": acl, "acl_error": acl_error}


def _file_acl(resolver: AclResolver, path: Path) -> tuple[frozenset[str], str] | str:
    """The file's ACL and its origin, or the reason it cannot be determined."""
    try:
        return resolver.resolve(path)
    except RagError as e:
        return str(e)
    except OSError as e:
        return f"cannot determine ACL: {e.strerror or e}"


def _record_hash(text: str, title: str | None, metadata: dict[str, Any]) -> str:
    # Canonical JSON, so key order and whitespace in the file don't change the hash; the
    # ACL is left out on purpose: an ACL change must not force re-embedding.
    canonical = json.dumps([text, title, metadata], sort_keys=True, ensure_ascii=False,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
