"""Progress reporting without tying the runner to a terminal (the CLI passes a rich-backed tracker), and the
run's stopwatch (:class:`Timings`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Advance = Callable[[int], None]


def _no_advance(_n: int = 1) -> None:
    return None


class Tracker:
    """No-op tracker; subclasses show progress bars."""

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        yield _no_advance

    def log(self, message: str) -> None:
        pass

    def reached(self, point: str) -> None:
        """A milestone of the run: ``compute`` (calibrated, before the stages run), ``save`` (the weights are written
        into the partial output folder, the recipe and report not yet) or ``replace`` (the new output is complete in
        its partial folder, before it replaces the old one). Nothing happens here; a caller's tracker may act (the
        output-safety tests signal a run at each)."""


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
        self._failed: tuple[str, BaseException] | None = None

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except BaseException as error:
            if self._failed is None or self._failed[1] is not error:  # the innermost step the error left
                self._failed = (label, error)
            raise
        finally:
            self.add(label, time.perf_counter() - start)

    def step_of(self, error: BaseException) -> str | None:
        """The label of the innermost step ``error`` was raised in (None: raised outside every step)."""
        return self._failed[0] if self._failed is not None and self._failed[1] is error else None

    def add(self, label: str, seconds: float) -> None:
        self.stages[label] = self.stages.get(label, 0.0) + seconds

    def as_dict(self) -> dict[str, object]:
        return {"total": time.perf_counter() - self.start, "stages": self.stages}
