"""Our progress display for ingest, shard seeding and merge: rich bars in a terminal or a notebook.

The CLI (`rag ingest`) and the Python API (`Rag.ingest`) show the same bars. Third-party bars
(transformers' "Loading weights") are silenced separately, by rag/quiet.py.
"""

from __future__ import annotations

import importlib.util

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

# How each stage the pipelines report (ingest, shard seeding, merge) is labelled, and its unit.
_STAGES = {
    "scan": ("counting sources", "sources"),
    "ingest": ("documents", "docs"),
    "embed": ("embedding", "chunks"),
    "copy": ("copying from the collection", "docs"),
    "merge": ("merging", "docs"),
}
_LOADING = "loading models"
_WIDGETS_HINT = "(install ipywidgets for a live progress bar in notebooks)"


def show_progress(choice: bool | None = None, console: Console | None = None) -> bool:
    """Whether to draw bars: `choice` if given, else on for a terminal or a notebook only.

    Job logs, pipes and captured output (tests, `rag ingest --json > out`) get no bars:
    cursor movements in a log file are noise.
    """
    if choice is not None:
        return choice
    console = console or Console(stderr=True)
    isatty = getattr(console.file, "isatty", None)
    return console.is_jupyter or bool(isatty and isatty())


def _has_ipywidgets() -> bool:
    return importlib.util.find_spec("ipywidgets") is not None


class _Count(ProgressColumn):
    """`done/total unit`, or `done unit` while the total is unknown."""

    def render(self, task: Task) -> Text:
        return Text(_count(task))


def _count(task: Task) -> str:
    unit = task.fields.get("unit", "")
    done = f"{int(task.completed):,}"
    return f"{done}/{int(task.total):,} {unit}" if task.total else f"{done} {unit}"


class _Rate(ProgressColumn):
    """Items per second over the last seconds (rich's estimate), plus tokens/s for embedding."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text("")
        text = f"{speed:,.1f} {task.fields.get('unit', '')}/s"
        tokens = task.fields.get("tokens")
        if tokens and task.elapsed:
            text += f", {tokens / task.elapsed:,.0f} tokens/s"
        return Text(text)


class IngestProgress:
    """One bar per stage while enabled (nothing otherwise); `update` is a pipeline ProgressFn.

    Use as a context manager. On a terminal the bars go to stderr and vanish when done (the
    caller prints a summary). In a notebook they stay, as a live widget when ipywidgets is
    installed; without it rich cannot redraw a cell, so each stage gets one summary line at the
    end instead. Notices go above the bars, and are printed plainly when the bars are off.
    """

    def __init__(self, enabled: bool, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        notebook = self.console.is_jupyter
        self._summary_only = enabled and notebook and not _has_ipywidgets()
        self._progress = Progress(TextColumn("{task.description:<12}"), BarColumn(), _Count(), _Rate(),
                                  TimeElapsedColumn(), console=self.console, transient=not notebook,
                                  disable=not enabled or self._summary_only)
        self._tasks: dict[str, TaskID] = {}
        self._loading: TaskID | None = None

    def __enter__(self) -> IngestProgress:
        self._progress.__enter__()
        self._loading = self._progress.add_task(_LOADING, total=None, unit="")
        if self._summary_only:
            self.notice(f"ingesting… {_WIDGETS_HINT}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)
        if self._summary_only:
            for task in self._progress.tasks:
                if task.id != self._loading:
                    self.notice(f"{task.description}: {_count(task)} in {task.elapsed or 0:.1f} s")

    def notice(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def update(self, stage: str, done: int, total: int) -> None:
        """(stage, done, total): one bar per stage, created when the stage first reports."""
        if self._loading is not None:
            self._progress.remove_task(self._loading)
            self._loading = None
        if stage == "tokens":  # shown beside the embedding rate
            if "embed" in self._tasks:
                self._progress.update(self._tasks["embed"], tokens=done)
            return
        if stage in ("ingest", "copy", "merge") and "scan" in self._tasks:
            self._progress.remove_task(self._tasks.pop("scan"))
        task = self._tasks.get(stage)
        if task is None:
            label, unit = _STAGES.get(stage, (stage, ""))
            task = self._tasks[stage] = self._progress.add_task(label, total=None, unit=unit)
        self._progress.update(task, completed=done, total=total or None)
