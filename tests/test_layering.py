"""The import rule of docs/architecture.md, checked on the source (every import, also the lazy
ones inside functions and those under TYPE_CHECKING: a lazy import is still a dependency).

- `ingest`, `retrieval`, `generation` and `permissions` import from `rag` only its base modules,
  which import nothing from the project but each other, and only the standard library at the
  top (`rag.quiet` touches transformers lazily, to silence it; `rag.forward_memo`, the test
  suite's memo of CPU forward passes, numpy and torch);
- `generation` imports nothing from `ingest`, `retrieval` or `permissions`;
- `permissions` imports nothing from `ingest`, `retrieval` or `generation`;
- `retrieval` imports nothing from `ingest` (ingest writes into retrieval's stores, not back),
  and neither of them imports `generation`. Both may use `permissions` (principals, ACL sources).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rag", "ingest", "retrieval", "generation", "permissions")
BASE = {"rag.errors", "rag.types", "rag.atomic", "rag.private_files", "rag.quiet", "rag.sqlite_threads",
        "rag.forward_memo", "rag.switch_interval"}
FORBIDDEN = {  # package -> project packages it must not import
    "ingest": {"generation"},
    "retrieval": {"ingest", "generation"},
    "generation": {"ingest", "retrieval", "permissions"},
    "permissions": {"ingest", "retrieval", "generation"},
}


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at top level) of every absolute project import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            # `from rag import errors` names the module rag.errors; `from rag.errors import X` names rag.errors
            module = next((n for n in names[1:] if n in BASE), node.module)
            found.append((node.lineno, module, id(node) in top))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, id(node) in top) for a in node.names)
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def violations(package: str) -> list[str]:
    out = []
    for path in modules_of(package):
        for line, module, _ in imports(path):
            root = module.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line} imports {module}"
            if root == "rag" and package != "rag" and module not in BASE:
                out.append(f"{where} (only the base modules of rag: {', '.join(sorted(BASE))})")
            if root in FORBIDDEN.get(package, set()):
                out.append(f"{where} ({package} must not depend on {root})")
    return out


@pytest.mark.parametrize("package", ["ingest", "retrieval", "generation", "permissions"])
def test_lower_packages_keep_the_import_rule(package):
    assert violations(package) == []


def test_the_base_modules_depend_only_on_each_other_and_the_standard_library():
    problems = []
    for module in sorted(BASE):
        path = REPO / (module.replace(".", "/") + ".py")
        for line, name, at_top in imports(path):
            root = name.split(".")[0]
            if root in PACKAGES and name not in BASE:
                problems.append(f"{module}:{line} imports {name}")
            elif root not in PACKAGES and at_top and root not in sys.stdlib_module_names and root != "__future__":
                problems.append(f"{module}:{line} imports {name} at the top (not the standard library)")
    assert problems == []


def test_the_rule_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself: an upward import hidden in a function, and one under TYPE_CHECKING."""
    fake = tmp_path / "retrieval"
    fake.mkdir()
    (fake / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rag.pipeline import Rag\n"
        "def f():\n    from ingest.chunk import Chunker\n    from rag import errors\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = violations("retrieval")
    assert len(found) == 2
    assert "rag.pipeline" in found[0] and "ingest.chunk" in found[1]


def test_every_package_is_checked():
    """A new top-level package must be placed in the rule, not silently left out of it."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench", "examples", "scripts"}
    assert packages == set(PACKAGES)
