"""A progress bar over an experiment's questions: rich in a terminal, live or one line in a notebook.

The same rules as the ingest bars (rag/progress.py): drawn in a terminal or a notebook, nothing
in logs and pipes; in a notebook without ipywidgets rich cannot redraw a cell, so one summary
line is printed at the end instead.
"""

from __future__ import annotations

import importlib.util
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rag.progress import show_progress


class QuestionProgress:
    """`update(done, total)` while asking; a context manager."""

    def __init__(self, enabled: bool | None = None, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.enabled = show_progress(enabled, self.console)
        widgets = importlib.util.find_spec("ipywidgets") is not None
        self._summary_only = self.enabled and self.console.is_jupyter and not widgets
        self._progress = Progress(TextColumn("asking"), BarColumn(), MofNCompleteColumn(), TextColumn("questions"),
                                  TimeElapsedColumn(), console=self.console, transient=not self.console.is_jupyter,
                                  disable=not self.enabled or self._summary_only)
        self._task = self._progress.add_task("asking", total=None)
        self._done, self._started = 0, time.perf_counter()

    def __enter__(self) -> QuestionProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)
        if self._summary_only and exc[0] is None:
            self.console.print(f"asked {self._done:,} question x configuration pairs in "
                               f"{time.perf_counter() - self._started:.1f} s", markup=False, highlight=False)

    def update(self, done: int, total: int) -> None:
        self._done = done
        self._progress.update(self._task, completed=done, total=total)
