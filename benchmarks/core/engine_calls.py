"""Every call a benchmark makes into slimkit's engine and stages, in one module: a recipe's memory plan, the stages
wrapped to measure them, the launched processes, and the run report a ``slimkit recipe run`` wrote. When the
engine's stage contract changes, this is the one benchmark module to port.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.core.inputs import read_json_file
from slimkit.engine.report import MACS_SEQ_LEN as MACS_SEQ_LEN  # the sequence length a report counts MACs at

if TYPE_CHECKING:
    import torch

    from slimkit.engine.processes import Processes
    from slimkit.engine.report import RunReport
    from slimkit.primitives.device.memory_model import MemoryPlan


def memory_plan(
    recipe: Any, config: Any, dtype: torch.dtype, device: torch.device | None = None, processes: int | None = None
) -> MemoryPlan:
    """The memory plan ``slimkit recipe run`` checks before loading (each stage's ``PlansMemory.memory``): ``recipe``
    (a validated recipe) on a model of ``config`` in ``dtype`` on ``device``; ``processes``: plan for this many
    launched processes (a sharded stage divides its training state among them) instead of this launch's."""
    from slimkit.engine.memory_check import recipe_memory_plan

    if processes is None:
        return recipe_memory_plan(recipe, config, dtype, device)
    launched = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(processes)
    try:
        return recipe_memory_plan(recipe, config, dtype, device)
    finally:
        if launched is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = launched


@contextmanager
def wrapped_stages(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Inside the block, every registered stage's work (``run_model``, ``run_layer``) runs as ``wrap(name, method)``;
    restored on leaving."""
    from slimkit.recipes import catalogue

    catalogue.load_stages()  # the stages registered before they are wrapped
    original = dict(catalogue.STAGES)
    try:
        for name, definition in original.items():
            measured = MeasuredStage(definition.stage, functools.partial(wrap, name))
            catalogue.STAGES[name] = dataclasses.replace(definition, stage=measured)
        yield
    finally:
        catalogue.STAGES.clear()
        catalogue.STAGES.update(original)


class MeasuredStage:
    """A stage whose work (``run_model``, ``run_layer``) runs through ``wrap(method)``; every other attribute is the
    stage's own, so it offers the same protocols."""

    def __init__(self, stage: object, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._stage, self._wrap = stage, wrap

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._stage, name)
        return self._wrap(value) if name in ("run_model", "run_layer") else value


def join_processes() -> Processes:
    """This process's place among the ones ``torchrun`` launched (one outside a launcher)."""
    from slimkit.engine.processes import join_processes as join

    return join()


def peak_rss_mb() -> float:
    """This process's peak resident memory, as a run report states its own."""
    from slimkit.engine.report import peak_rss_mb as peak

    return peak()


def read_run_report(folder: Path) -> RunReport | None:
    """The run report ``folder/report.json``, or None when it is missing or not one (a report of an older slimkit
    that lacks a field this one needs); read with bounds (a FIFO, a huge or deeply nested file is one line)."""
    from pydantic import ValidationError

    from slimkit.engine.report import RunReport

    path = Path(folder) / "report.json"
    if not os.path.lexists(path):
        return None
    data = read_json_file(path, "a kept run report")
    try:
        return RunReport.model_validate(data)
    except ValidationError:
        return None
