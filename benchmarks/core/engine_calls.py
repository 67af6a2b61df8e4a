"""Every call a benchmark makes into slimkit's engine and stages, in one module: a recipe's memory plan, the stages
wrapped to measure them, the launched processes, and the run report a ``slimkit recipe run`` wrote. When the
engine's stage contract changes, this is the one benchmark module to port.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import dataclasses
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
    """The memory plan ``slimkit recipe run`` checks before loading (each stage's ``StageArgs.memory``): ``recipe``
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
    """Inside the block, every registered stage runs as ``wrap(name, its function)``; restored on leaving."""
    import slimkit.stages  # noqa: F401  (registers the stages before they are wrapped)
    from slimkit.engine import registry

    original = dict(registry.STAGES)
    try:
        for name, stage in original.items():
            registry.STAGES[name] = dataclasses.replace(stage, fn=wrap(name, stage.fn))
        yield
    finally:
        registry.STAGES.clear()
        registry.STAGES.update(original)


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
