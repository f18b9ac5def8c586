"""The live display of `rag ingest` on a terminal: one bar per stage, with its rate."""

from __future__ import annotations

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


class _Count(ProgressColumn):
    """`done/total unit`, or `done unit` while the total is unknown."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        done = f"{int(task.completed):,}"
        return Text(f"{done}/{int(task.total):,} {unit}" if task.total else f"{done} {unit}")


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
    """Bars on stderr while a TTY is attached (nothing otherwise); `update` is a pipeline ProgressFn.

    Use as a context manager. Notices go to stderr above the bars, and are printed plainly
    when the bars are off (job logs).
    """

    def __init__(self, enabled: bool) -> None:
        self.console = Console(stderr=True, highlight=False)
        self._progress = Progress(TextColumn("{task.description:<12}"), BarColumn(), _Count(), _Rate(),
                                  TimeElapsedColumn(), console=self.console, transient=True,
                                  disable=not enabled)
        self._tasks: dict[str, TaskID] = {}
        self._loading: TaskID | None = None

    def __enter__(self) -> IngestProgress:
        self._progress.__enter__()
        self._loading = self._progress.add_task("loading models", total=None, unit="")
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def notice(self, message: str) -> None:
        self.console.print(message, markup=False, soft_wrap=True)

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
