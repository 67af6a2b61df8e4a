"""Progress reporting without tying the runner to a terminal (the CLI passes a rich-backed tracker), and the
run's stopwatch (:class:`Timings`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from slimkit.recipes.memory_plan import memory_errors

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
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        rate = TextColumn("{task.fields[rate]}")
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            rate,
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as progress:
            task_id = progress.add_task(description, total=total, rate="")

            def advance(n: int = 1) -> None:
                progress.advance(task_id, n)
                speed = next(task.speed for task in progress.tasks if task.id == task_id)
                shown = "" if not speed else f"{speed:,.0f}/s" if speed >= 10 else f"{speed:.2g}/s"
                progress.update(task_id, rate=shown)

            yield advance

    def log(self, message: str) -> None:
        self.console.print(message)


class Timings:
    """Seconds per labelled step of a run (summed when a label repeats), and the run's total."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with memory_errors(label):  # an out-of-memory error becomes one error line naming the stage
                yield
        finally:
            self.add(label, time.perf_counter() - start)

    def add(self, label: str, seconds: float) -> None:
        self.stages[label] = self.stages.get(label, 0.0) + seconds

    def as_dict(self) -> dict[str, object]:
        return {"total": time.perf_counter() - self.start, "stages": self.stages}
