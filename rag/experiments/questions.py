"""Labelled question sets: the project's JSONL format, and a reader that picks the format of a path.

A question names who asks (`user`, `groups`), the sources that answer it and, optionally, a
short expected fact. Sources are labels: paths relative to the corpus root as ingest stores
them (`imaging/booking.md`), `file.jsonl#record` for a JSONL record, or a whole `file.jsonl`.

Two label fields exist in the wild, and both are read:

- `sources`: every source that answers the question, whether the asker may read it or not
  (examples/eval/postgresql/questions.jsonl);
- `relevant`: the answer sources the label's author believed the asker may read
  (examples/questions.jsonl, which has no `sources`).

Whether the asker may read a source is decided later from the ingested documents' stored
ACLs (`rag.experiments.ground_truth`), not from which field names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from permissions.models import Principal
from rag.errors import ConfigError


@dataclass(frozen=True)
class Question:
    """One labelled question, as asked by one principal.

    `grades` gives graded relevance for nDCG (BEIR qrels); a source without a grade counts 1.
    """

    id: str
    text: str
    user: str
    groups: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    expected: str | None = None
    grades: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    @property
    def principal(self) -> Principal:
        return Principal(self.user, frozenset(self.groups))

    def grade(self, source: str) -> int:
        return self.grades.get(source, 1)


@dataclass(frozen=True)
class QuestionSet:
    """Questions, plus where their corpus is when the set brings one (a BEIR folder does)."""

    questions: list[Question]
    name: str
    # A folder of JSONL records to ingest, labels relative to it (None: the caller's corpus).
    corpus: Path | None = None


def read_jsonl(path: str | Path) -> QuestionSet:
    """Read the project's JSONL question format (one object per line).

    Fields: `question`, `user` (required); `groups`, `sources`, `relevant`, `forbidden`,
    `expected` (or `expect_contains`, the older name), `id` (default: the line number).

    Raises:
        ConfigError: the file is unreadable, or a line is not a valid question (its line is named).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read question file {path}: {e.strerror or e}") from e
    questions = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not obj["question"].strip():
            raise ConfigError(f"{where}: expected an object with a non-empty 'question'")
        if not isinstance(obj.get("user"), str) or not obj["user"]:
            raise ConfigError(f"{where}: 'user' (who asks) is missing: every question is asked by someone")
        # `sources` is the superset when both are given; `relevant` alone is the older format.
        sources = tuple(dict.fromkeys([*obj.get("sources", ()), *obj.get("relevant", ())]))
        expected = obj.get("expected", obj.get("expect_contains"))
        questions.append(Question(
            id=str(obj.get("id", f"{path.stem}:{lineno}")), text=obj["question"], user=obj["user"],
            groups=tuple(obj.get("groups", ())), sources=sources, forbidden=tuple(obj.get("forbidden", ())),
            expected=expected or None))
    return QuestionSet(questions, path.stem)


def read_questions(path: str | Path, split: str = "test") -> QuestionSet:
    """A question set from a JSONL file, or from a BEIR folder (corpus.jsonl, queries.jsonl, qrels/).

    Raises:
        ConfigError: the path does not exist or is neither format.
    """
    from rag.experiments.beir import is_beir_folder, read_beir

    path = Path(path)
    if path.is_dir():
        if not is_beir_folder(path):
            raise ConfigError(f"{path} is a folder but not a BEIR set: it needs corpus.jsonl, queries.jsonl and "
                              "qrels/*.tsv; or pass a .jsonl question file")
        return read_beir(path, split)
    if not path.exists():
        raise ConfigError(f"question file {path} does not exist")
    return read_jsonl(path)
