"""Which rows of ``python -m benchmarks.scale --jobs N`` run at the same time: admission by expected peak memory.

Pure functions (no process, no device): a row's expected peak, whether the next row may start beside the running
ones, whether a row that ran short of memory beside others is run again alone, and a simulation of the schedule.
Method note: docs/methods/benchmark-harness.md (``--jobs``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 2**30
PLAN_MARGIN = 1.2
"""Expected peak = the larger of the memory plan and an earlier measured peak, times this, plus PROCESS_BYTES."""
PROCESS_BYTES = GIB
"""Per process beside the counted tensors: the CUDA context and what the caching allocator reserves above them."""
MEMORY_FRACTION = 0.9
"""Default share of the device's memory the running rows' expected peaks may sum to (``--memory-fraction``)."""
_PLAN_REFUSAL = re.compile(r"needs about [\d.]+ GiB on \S+ .*has [\d.]+ GiB")


@dataclass(frozen=True)
class Demand:
    """What a row reserves while it runs: its expected peak memory on the run's device and the bytes it may
    write to the scratch disk (its saved model), both in bytes; ``math.inf`` memory: it runs alone."""

    memory: float
    disk: float = 0.0


def expected_peak(planned: float | None, measured: float | None, device: float = math.inf) -> float:
    """A row's expected peak in bytes from its memory plan and an earlier measured peak (either may be None);
    ``math.inf`` (run alone) when neither is known. A plan above the whole ``device`` is refused by the run's own
    check before it loads anything, so such a row holds only its process (PROCESS_BYTES) and need not run alone."""
    if planned is not None and planned > device:
        return float(PROCESS_BYTES)
    known = [value for value in (planned, measured) if value is not None]
    return max(known) * PLAN_MARGIN + PROCESS_BYTES if known else math.inf


def blocked_by(head: Demand, running: Sequence[Demand], memory: float, disk_free: float, jobs: int) -> str | None:
    """Why the next row (``head``) cannot start now, or None when it can: it always can when nothing runs (a row too
    large for the device runs alone and finds out itself); else fewer than ``jobs`` must run and the running rows'
    demands plus its own must fit under ``memory`` (bytes the rows may use together) and ``disk_free`` (the scratch
    disk's free bytes now)."""
    if not running:
        return None
    if len(running) >= jobs:
        return f"{len(running)} rows run (--jobs {jobs})"
    held = sum(r.memory for r in running)
    if held + head.memory > memory:
        return f"memory: {_gib(held)} expected beside {_gib(head.memory)} > {_gib(memory)} GiB"
    written = sum(r.disk for r in running)
    if written + head.disk > disk_free:
        return f"scratch disk: {_gib(written)} beside {_gib(head.disk)} > {_gib(disk_free)} GiB free"
    return None


def can_start(head: Demand, running: Sequence[Demand], memory: float, disk_free: float, jobs: int) -> bool:
    """Whether the next row starts now (:func:`blocked_by` gives no reason to wait)."""
    return blocked_by(head, running, memory, disk_free, jobs) is None


def _gib(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value / GIB:.1f}"


def short_of_memory(row: dict[str, Any]) -> bool:
    """Whether a finished row ran out of memory: killed or an out-of-memory error (status ``oom``), or refused by
    its memory plan's check of the device's free memory (the ``needs about X GiB on D ... has Y GiB`` line)."""
    if row.get("status") == "oom":
        return True
    return row.get("status") == "failed" and _PLAN_REFUSAL.search(row.get("reason") or "") is not None


def rerun_alone(row: dict[str, Any], device: float = math.inf) -> bool:
    """Whether a row is run again, alone, at the end: it ran short of memory while others ran beside it, it is not
    itself such a re-run (once), and its plan (``planned_peak_mb``) fits the ``device`` (bytes): a plan above the
    device is refused alone as well."""
    planned = row.get("planned_peak_mb")
    if planned is not None and planned * 2**20 > device:
        return False
    return bool(row.get("beside")) and "rerun_of" not in row and short_of_memory(row)


def simulate(
    demands: Sequence[Demand], seconds: Sequence[float], memory: float, jobs: int, disk_free: float = math.inf
) -> list[float]:
    """Start times of rows that take ``seconds`` each, started in order under :func:`can_start` (no row overtakes
    one that waits); the last row ends at ``max(start + seconds)``. For the device-time arithmetic and the tests."""
    starts: list[float] = []
    running: list[tuple[float, Demand]] = []  # (end time, demand)
    now = 0.0
    for demand, duration in zip(demands, seconds, strict=True):
        while not can_start(demand, [d for _end, d in running], memory, disk_free, jobs):
            now = min(end for end, _d in running)
            running = [(end, d) for end, d in running if end > now]
        starts.append(now)
        running.append((now + duration, demand))
    return starts


__all__ = [
    "GIB",
    "MEMORY_FRACTION",
    "PLAN_MARGIN",
    "PROCESS_BYTES",
    "Demand",
    "blocked_by",
    "can_start",
    "expected_peak",
    "rerun_alone",
    "short_of_memory",
    "simulate",
]
