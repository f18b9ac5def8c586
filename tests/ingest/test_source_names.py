"""What citations call a source: the path under the ingest root or a configured URL, never the server path."""

from __future__ import annotations

from pathlib import Path

from ingest.parse import parse_item
from ingest.source_names import SourceNamer
from ingest.sources import SourceItem, walk_sources


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "srv" / "lab-docs"
    (root / "imaging").mkdir(parents=True)
    (root / "imaging" / "scope booking.md").write_text("# Booking\n\nBook the confocal a week ahead.\n")
    (root / "notes.jsonl").write_text('{"id": "r1", "text": "Record one."}\n')
    return root


def _items(root: Path, namer: SourceNamer | None = None) -> dict[str, SourceItem]:
    return {Path(i.key).name.split("#")[0]: i for i in walk_sources([root], namer=namer)
            if isinstance(i, SourceItem)}


def test_sources_are_named_under_their_root_and_never_by_server_path(tmp_path):
    root = _tree(tmp_path)
    items = _items(root)
    assert items["scope booking.md"].display == "lab-docs/imaging/scope booking.md"
    assert items["notes.jsonl"].display == "lab-docs/notes.jsonl#r1"
    for item in items.values():
        doc = parse_item(item)
        assert doc.key.startswith(str(tmp_path))  # the key stays the absolute path: incremental ingest
        assert str(tmp_path) not in doc.source and not doc.source.startswith("/")


def test_a_single_file_root_is_named_with_its_directory(tmp_path):
    root = _tree(tmp_path)
    (item,) = [i for i in walk_sources([root / "imaging" / "scope booking.md"]) if isinstance(i, SourceItem)]
    assert item.display == "imaging/scope booking.md"


def test_a_published_tree_is_named_by_its_url_and_the_deepest_tree_wins(tmp_path):
    root = _tree(tmp_path)
    namer = SourceNamer({str(root): "https://wiki.example.org/docs/",
                         str(root / "imaging"): "https://imaging.example.org/kb"})
    items = _items(root, namer)
    assert items["scope booking.md"].display == "https://imaging.example.org/kb/scope%20booking.md"
    assert items["notes.jsonl"].display == "https://wiki.example.org/docs/notes.jsonl#r1"


def test_a_path_outside_every_tree_and_root_is_only_its_file_name():
    assert SourceNamer().name(Path("/elsewhere/secret-project/plan.md"), Path("/srv/lab-docs")) == "plan.md"
