"""A rich progress bar for engine runs (the engine's :class:`~statelab.experiments.engine.Progress`):
units done, failures, elapsed time and ETA."""
from __future__ import annotations

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from statelab.experiments import engine


class RichReporter(engine.Progress):
    def __init__(self, console, label: str = "cells", transient: bool = False):
        self.console, self.label, self.transient = console, label, transient
        self.progress = None
        self.task = None
        self.failed = 0

    def phase(self, text: str) -> None:
        if self.progress is None:
            self.console.print(f"[dim]{text}…[/dim]")

    def start(self, total: int, done: int, withheld: int) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("failures {task.fields[failed]}"), TextColumn("withheld {task.fields[withheld]}"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=self.console, transient=self.transient)
        self.progress.start()
        self.task = self.progress.add_task(self.label, total=total, completed=done + withheld, failed=0,
                                           withheld=withheld)

    def advance(self, record: dict) -> None:
        if record.get("status") != "ok":
            self.failed += 1
            self.progress.console.print(f"[red]{self.label.rstrip('s')} {record['key']} failed: {record.get('error', '')[:200]}[/red]",
                                        markup=True, highlight=False)
            self.progress.update(self.task, failed=self.failed)
        else:
            self.progress.advance(self.task)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
