"""The queue of ``python -m benchmarks.scale``'s rows: each started in its own thread and process when the rules of
``benchmarks/scale_jobs.py`` admit it beside the running ones (``--jobs``), cut at ``--budget-s``, a row short of
memory beside others run again alone at the end.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import math
import os
import queue as queue_module
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.core.inputs import read_json_file
from benchmarks.core.processes import log
from benchmarks.scale_jobs import PLAN_MARGIN, PROCESS_BYTES, Demand, blocked_by, expected_peak, rerun_alone
from benchmarks.scale_process import run_one, skipped_row, stop_group
from benchmarks.scale_recipes import planned_peak
from benchmarks.scale_shapes import Shape, build_device, dtype_bytes

MIN_ROW_S = 15.0
"""A row is not started with less of ``--budget-s`` left (starting the process and loading take about that)."""


@dataclass
class Queued:
    """A row waiting to start: what it runs, what it reserves beside others (``--jobs``), and for a row run again
    alone, its first attempt."""

    shape: Shape
    sweeps: list[str]
    recipe: str
    memory: str | None
    label: str
    demand: Demand = field(default_factory=lambda: Demand(0.0))
    planned: float | None = None
    first: dict[str, Any] | None = None
    beside: set[str] = field(default_factory=set)
    waiting: str | None = None

    @property
    def row_id(self) -> str:
        return f"{self.shape.name}/{self.recipe}" + ("@offload" if self.memory else "")

    @property
    def reserved(self) -> Demand:
        """What it holds while it runs: a re-run holds the whole device (nothing starts beside it)."""
        return self.demand if self.first is None else Demand(math.inf, self.demand.disk)


def known_peaks(paths: list[Path]) -> dict[tuple[str, str | None, str], float]:
    """The largest peak GPU memory (bytes) measured per (row id, --max-memory, dtype) in earlier results files."""
    found: dict[tuple[str, str | None, str], float] = {}
    for path in paths:
        result = read_json_file(path, "--known-peaks")
        dtype = str((result.get("settings") or {}).get("dtype"))
        for row in result.get("rows") or []:
            if isinstance(row, dict) and row.get("status") == "ok" and row.get("peak_gpu_mb"):
                key = (str(row.get("id")), row.get("max_memory"), dtype)
                found[key] = max(found.get(key, 0.0), float(row["peak_gpu_mb"]) * 2**20)
    return found


def device_bytes(device: str) -> int:
    """Memory of the runs' device: the GPU's total, or the machine's RAM for the CPU."""
    import torch

    where = build_device(device)
    if where.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(where)).total_memory
    import psutil

    return psutil.virtual_memory().total


def admit_rows(
    queue: list[Queued], args: argparse.Namespace, dtype: str, result: dict[str, Any]
) -> tuple[float, float]:
    """Set each queued row's demand for ``--jobs``: expected peak (:func:`benchmarks.scale_jobs.expected_peak` of
    its plan and the largest peak ``--known-peaks`` measured for it) and its saved model's size on the scratch disk
    (at most the dense weights); record the settings used; the bytes the running rows may use together and
    the device's memory."""
    known = known_peaks(args.known_peaks)
    total = device_bytes(args.device)
    capacity = total * args.memory_fraction
    for entry in queue:
        entry.planned = planned_peak(entry.shape, entry.recipe, args, dtype, entry.memory)
        measured = known.get((entry.row_id, entry.memory, dtype))
        weights = entry.shape.params()["total"] * dtype_bytes(dtype)
        entry.demand = Demand(expected_peak(entry.planned, measured, total), float(weights))
    result["settings"]["concurrency"] = {
        "jobs": args.jobs,
        "memory_fraction": args.memory_fraction,
        "device_gib": total / 2**30,
        "capacity_gib": capacity / 2**30,
        "plan_margin": PLAN_MARGIN,
        "process_gib": PROCESS_BYTES / 2**30,
        "known_peaks": [str(p) for p in args.known_peaks],
    }
    return capacity, total


def disk_free(folder: Path) -> float:
    """Bytes the running rows may still write under ``folder`` beside a new one: the file system's free bytes plus
    what the rows already wrote there (each running row's reservation counts its whole saved model)."""
    import shutil

    written = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            try:
                written += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except OSError:  # removed meanwhile by its run
                pass
    return float(shutil.disk_usage(folder).free + written)


def mb(value: float | None) -> float | None:
    """Bytes as MiB (None for an unknown or infinite value)."""
    return None if value is None or math.isinf(value) else value / 2**20


@dataclass
class RowQueue:
    """The rows of one scale run and what they share: the arguments, the dtype, the scratch folder, the benchmark's
    start (``--budget-s`` counts from it), how a shape's saved model is found and how a finished row is recorded."""

    args: argparse.Namespace
    dtype: str
    scratch: Path
    start: float
    folder_of: Callable[[Shape], Path]
    record: Callable[[dict[str, Any]], None]
    baseline: tuple[Shape, dict[str, Any]]
    """The baseline's shape and row: an ok baseline is that shape's wanda-channels row (run once, not twice)."""
    running: dict[str, Queued] = field(default_factory=dict)
    finished: queue_module.Queue[tuple[str, dict[str, Any]]] = field(default_factory=queue_module.Queue)
    live: set[subprocess.Popen[bytes]] = field(default_factory=set)

    def left_s(self) -> float | None:
        """Seconds of ``--budget-s`` left (None without a budget)."""
        return None if self.args.budget_s is None else self.args.budget_s - (time.perf_counter() - self.start)

    def start_row(self, entry: Queued, folder: Path, timeout_s: float | None) -> None:
        """``entry`` run in a thread of its own; its row is put in :attr:`finished`."""

        def work() -> None:
            try:
                row = run_one(
                    entry.shape,
                    entry.sweeps,
                    folder,
                    entry.recipe,
                    self.args,
                    self.dtype,
                    self.scratch,
                    entry.memory,
                    timeout_s=timeout_s,
                    live=self.live,
                )
            except Exception as error:  # a crash of the harness itself is that row's result, not a hang
                row = {
                    **skipped_row(entry.shape, entry.sweeps, entry.recipe, entry.memory, self.dtype),
                    "status": "failed",
                    "reason": f"{type(error).__name__}: {error}"[:400],
                }
            self.finished.put((entry.row_id, row))

        for other in self.running.values():
            other.beside.add(entry.row_id)
            entry.beside.add(other.row_id)
        self.running[entry.row_id] = entry
        threading.Thread(target=work, daemon=True).start()

    def cut(self, entry: Queued, left: float) -> None:
        """Record ``entry`` as not run: too little of ``--budget-s`` left."""
        reason = (
            f"not run: {max(left, 0):.0f} s of --budget-s {self.args.budget_s:.0f} s left (runs go "
            "cheapest first by an estimate from the layers' size and the recipe's stages)"
        )
        if entry.first is not None:  # a re-run that no longer fits the budget: the first attempt
            again = f"{entry.first.get('reason')} (beside other rows; not run again alone: {reason})"
            self.record(entry.first | {"reason": again[:600]})
        else:
            self.record(
                {**skipped_row(entry.shape, entry.sweeps, entry.recipe, entry.memory, self.dtype), "reason": reason}
            )

    def start_next(self, queue: list[Queued], capacity: float) -> bool:
        """Start (or record) the first queued row when the rules admit it; False when it has to wait."""
        entry = queue[0]
        left = self.left_s()
        if left is not None and left < MIN_ROW_S:
            queue.pop(0)
            self.cut(entry, left)
            return True
        others = [e.reserved for e in self.running.values()]
        wait = blocked_by(entry.reserved, others, capacity, disk_free(self.scratch), self.args.jobs)
        if wait is not None:
            if wait != entry.waiting:
                log(f"{entry.label} waits: {wait}")
                entry.waiting = wait
            return False
        queue.pop(0)
        log(
            entry.label
            + (f" with --max-memory {entry.memory}" if entry.memory else "")
            + (f" (beside {len(self.running)} running)" if self.running else "")
            + (" (again, alone)" if entry.first is not None else "")
        )
        try:
            folder = self.folder_of(entry.shape)
        except Exception as error:  # a shape that cannot be built is a row, not a crash
            row = skipped_row(entry.shape, entry.sweeps, entry.recipe, entry.memory, self.dtype)
            reason = f"building the model: {type(error).__name__}: {error}"[:400]
            self.record(row | {"status": "failed", "max_memory": entry.memory, "reason": reason})
            return True
        base_shape, baseline = self.baseline
        if (entry.shape, entry.recipe, entry.memory) == (base_shape, "wanda-channels", None) and baseline[
            "status"
        ] == "ok":
            self.record({**baseline, "kind": entry.sweeps[0], "sweeps": entry.sweeps, "baseline_run": True})
            return True
        self.start_row(entry, folder, self.left_s())
        return True

    def run(self, queue: list[Queued], capacity: float, device_total: float) -> None:
        """Every queued row run (or cut); a running process is stopped if this ends early (Ctrl-C, SIGTERM)."""
        try:
            while queue or self.running:
                while queue and self.start_next(queue, capacity):
                    pass
                if not self.running:
                    continue
                key, row = self.finished.get()
                entry = self.running.pop(key)
                if self.args.jobs > 1:
                    row |= {"beside": sorted(entry.beside), "expected_peak_mb": mb(entry.demand.memory)}
                    row["planned_peak_mb"] = mb(entry.planned)
                    if entry.first is not None:
                        row["rerun_of"] = {k: entry.first.get(k) for k in ("status", "reason", "beside")}
                if rerun_alone(row, device_total):
                    log(f"  {row['id']}: {row['status']} beside {', '.join(row['beside'])}: run again alone at the end")
                    queue.append(replace(entry, first=row, beside=set()))
                    continue
                self.record(row)
        finally:
            for process in list(self.live):  # an interrupted benchmark leaves no run behind
                stop_group(process)
