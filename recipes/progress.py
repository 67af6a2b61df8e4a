"""Progress reporting without tying the runner to a terminal: the CLI passes a rich-backed tracker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[int], None]


class Tracker:
    """No-op tracker; subclasses show progress bars."""

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        yield lambda _n=1: None

    def log(self, message: str) -> None:
        pass


class RichTracker(Tracker):
    def __init__(self, console=None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=False) as progress:
            task_id = progress.add_task(description, total=total)
            yield lambda n=1: progress.advance(task_id, n)

    def log(self, message: str) -> None:
        self.console.print(message)
