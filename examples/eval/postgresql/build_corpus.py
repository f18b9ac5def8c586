"""Copy Debian's PostgreSQL 15 HTML manual into a labrag corpus, one folder per part, each with its ACL.

    python examples/eval/postgresql/build_corpus.py DEST [--source DIR] [--pages FILE.html ...]

The manual (apt-get install postgresql-doc-15) is a flat folder of ~1170 pages. Each page's
"Up" link leads to the part of the manual it belongs to; the page is copied into that part's
folder under DEST and the folder gets a `.rag-acl.toml` sidecar, so that the labelled questions
exercise permissions (see README.md next to this script for the table). A page whose part
cannot be determined lands at the top of DEST, where the root sidecar lets nobody read it:
an unknown ACL denies. Re-running is cheap: unchanged pages keep their times, so `rag ingest`
skips them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MANUAL = Path("/usr/share/doc/postgresql-doc-15/html")
INSTALL_HINT = "install the manual first: apt-get install postgresql-doc-15"


@dataclass(frozen=True)
class Area:
    """A corpus folder: the parts of the manual it holds and who may read them."""

    folder: str
    allow: tuple[str, ...]
    parts: str  # for the sidecar's comment and the README


AREAS: dict[str, Area] = {a.folder: a for a in (
    Area("public", ("public",), "front matter, Part I Tutorial, Part II The SQL Language, Appendixes, index"),
    Area("admin", ("group:dba",), "Part III Server Administration"),
    Area("server-apps", ("group:dba",), "Reference III PostgreSQL Server Applications"),
    Area("client-apps", ("group:dba", "group:developers"), "Reference II PostgreSQL Client Applications"),
    Area("sql-commands", ("group:developers",), "Reference I SQL Commands"),
    Area("programming", ("group:developers",), "Part IV Client Interfaces, Part V Server Programming"),
    Area("internals", ("group:developers",), "Part VII Internals"),
)}

# The page that heads each part (the last page before index.html on the "Up" chain; for the
# Reference part, the sub-part below reference.html) -> its corpus folder.
PART_FOLDERS = {
    "index.html": "public", "legalnotice.html": "public", "preface.html": "public",
    "tutorial.html": "public", "sql.html": "public", "appendixes.html": "public",
    "biblio.html": "public", "bookindex.html": "public", "reference.html": "public",
    "admin.html": "admin",
    "reference-server.html": "server-apps",
    "reference-client.html": "client-apps",
    "sql-commands.html": "sql-commands",
    "client-interfaces.html": "programming", "server-programming.html": "programming",
    "internals.html": "internals",
}

_UP_LINK = re.compile(r'<a accesskey="u" href="([^"#]+)')


def up_links(source: Path) -> dict[str, str | None]:
    """page file name -> the file name its "Up" link points at (None for the top pages)."""
    out: dict[str, str | None] = {}
    for page in sorted(source.glob("*.html")):
        match = _UP_LINK.search(page.read_text(encoding="utf-8", errors="replace"))
        out[page.name] = match.group(1) if match else None
    return out


def part_of(page: str, up: dict[str, str | None]) -> str | None:
    """The page heading the part `page` belongs to, or None if its chain is broken or loops."""
    chain = [page]
    while (parent := up.get(chain[-1])) not in (None, "index.html"):
        if parent not in up or parent in chain:
            return None
        chain.append(parent)
    head = chain[-1]
    if head == "reference.html" and len(chain) > 1:
        return chain[-2]  # Reference has three sub-parts with different readers
    return head


def page_folders(source: Path = MANUAL) -> dict[str, str]:
    """page file name -> corpus folder ('' for a page whose part is unknown: readable by nobody)."""
    up = up_links(source)
    return {page: PART_FOLDERS.get(part_of(page, up) or "", "") for page in up}


def sidecar_text(area: Area) -> str:
    allow = ", ".join(f'"{entry}"' for entry in area.allow)
    return f"# {area.parts} of the PostgreSQL 15 manual.\nallow = [{allow}]\n"


ROOT_SIDECAR = ("# Safe default: a page whose part of the manual could not be determined stays here,\n"
                "# readable by nobody. Each folder below has its own .rag-acl.toml.\nallow = []\n")


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def build_corpus(dest: Path, source: Path = MANUAL, pages: Iterable[str] | None = None) -> dict[str, str]:
    """Copy the manual's pages (all, or the named ones) into `dest`, with the sidecars.

    Returns: page file name -> its path relative to `dest` (as the labelled questions name it).
    Raises: FileNotFoundError when the manual (or a named page) is not there.
    """
    if not (source / "index.html").is_file():
        raise FileNotFoundError(f"no PostgreSQL manual at {source}: {INSTALL_HINT}")
    folders = page_folders(source)
    wanted = sorted(folders) if pages is None else sorted(set(pages))
    unknown = [p for p in wanted if p not in folders]
    if unknown:
        raise FileNotFoundError(f"not pages of the manual at {source}: {', '.join(unknown)}")
    dest.mkdir(parents=True, exist_ok=True)
    _write_if_changed(dest / ".rag-acl.toml", ROOT_SIDECAR)
    for area in AREAS.values():
        (dest / area.folder).mkdir(exist_ok=True)
        _write_if_changed(dest / area.folder / ".rag-acl.toml", sidecar_text(area))
    placed = {}
    for page in wanted:
        rel = f"{folders[page]}/{page}" if folders[page] else page
        target = dest / rel
        src = source / page
        # copy2 keeps the manual's mtime, so an unchanged page is skipped by incremental ingest.
        if not target.exists() or target.stat().st_size != src.stat().st_size \
                or target.stat().st_mtime != src.stat().st_mtime:
            shutil.copy2(src, target)
        placed[page] = rel
    return placed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="corpus directory to create or update")
    parser.add_argument("--source", type=Path, default=MANUAL, help=f"the manual's HTML folder (default {MANUAL})")
    parser.add_argument("--pages", nargs="+", metavar="FILE.html",
                        help="copy only these pages (file names as in the manual), e.g. for a quick run")
    args = parser.parse_args(argv)
    try:
        placed = build_corpus(args.dest, args.source, args.pages)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for rel in placed.values():
        folder = rel.partition("/")[0] if "/" in rel else "(top: nobody)"
        counts[folder] = counts.get(folder, 0) + 1
    for folder, n in sorted(counts.items()):
        print(f"{n:5d}  {folder}/  {', '.join(AREAS[folder].allow) if folder in AREAS else ''}")
    print(f"{len(placed)} pages in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
