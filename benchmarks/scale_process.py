"""One row of ``python -m benchmarks.scale``: a recipe run by ``slimkit recipe run`` in its own process on a saved
random-weight model, its memory sampled from ``/proc`` while it runs, killed at a deadline, its report read.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core.inputs import read_json_file
from benchmarks.core.processes import (
    OFFLINE_ENV,
    QUIET_ENV,
    last_line,
    load_average,
    recipe_run,
    thread_env,
    via_launcher,
)
from benchmarks.scale_recipes import scale_recipe, split_variant, target_of
from benchmarks.scale_shapes import Shape, dtype_bytes
from slimkit.primitives.files.removal import discard


def _rss_parts(pid: int) -> dict[str, int]:
    """``RssAnon`` / ``RssFile`` / ``RssShmem`` of a process in kB (Linux ``/proc``; empty elsewhere)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    parts = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            parts[key] = int(value.split()[0])
    return parts


def sample_memory(
    process: subprocess.Popen, every_s: float = 0.2, deadline: float | None = None
) -> dict[str, float | None]:
    """Wait for ``process``, sampling its descendants' resident memory: the peak of anonymous memory (what
    a memory budget controls) and of file-backed pages (memory-mapped weights: page cache the kernel can
    drop, yet counted in ``ru_maxrss``, the report's peak RSS). Sampled, so a peak shorter than
    ``every_s`` can be missed; None where ``/proc`` is unavailable. Past ``deadline`` (a ``time.perf_counter``
    value) the process group is killed and ``timed_out`` is set."""
    import psutil

    anon = file = 0
    seen = False
    cpu: dict[str, float] = {}
    while not _ended(process, cpu):
        if deadline is not None and time.perf_counter() > deadline:
            stop_group(process, cpu)
            sampled = {"peak_anon_mb": anon / 1024, "peak_file_mb": file / 1024} if seen else {}
            return {"peak_anon_mb": None, "peak_file_mb": None, **sampled, **cpu, "timed_out": True}
        try:
            pids = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        except psutil.Error:
            pids = []
        parts = [_rss_parts(pid) for pid in pids]
        if any(parts):
            seen = True
            anon = max(anon, sum(p.get("RssAnon", 0) + p.get("RssShmem", 0) for p in parts))
            file = max(file, sum(p.get("RssFile", 0) for p in parts))
        time.sleep(every_s)
    if not seen:
        return {"peak_anon_mb": None, "peak_file_mb": None, **cpu}
    return {"peak_anon_mb": anon / 1024, "peak_file_mb": file / 1024, **cpu}


def _ended(process: subprocess.Popen, cpu: dict[str, float]) -> bool:
    """Whether ``process`` ended (reaped without blocking); when it did, ``cpu["cpu_s"]`` is its CPU seconds with
    its waited-for descendants' (``wait4``: this process's own, whatever other runs end beside it)."""
    if not hasattr(os, "wait4") or process.returncode is not None:
        return process.poll() is not None
    try:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere
        return process.poll() is not None
    if pid == 0:
        return False
    process.returncode = os.waitstatus_to_exitcode(status)
    cpu["cpu_s"] = usage.ru_utime + usage.ru_stime
    return True


def stop_group(process: subprocess.Popen, cpu: dict[str, float] | None = None) -> None:
    """Kill a run started in its own session (the launcher and the run it started) and reap it; ``cpu`` gets its
    CPU seconds as :func:`sample_memory` records them."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while not _ended(process, {} if cpu is None else cpu):
        time.sleep(0.02)


OOM_MARKERS = ("OutOfMemoryError", "out of memory", "MemoryError")


def out_of_memory(log_text: str) -> bool:
    """Whether a failed run's output says it ran out of memory (CUDA or host)."""
    return any(marker in log_text for marker in OOM_MARKERS)


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _killed(returncode: int) -> bool:
    return returncode in (-9, 137, 247)  # SIGKILL: directly, through a shell, or through the launcher's sys.exit


def run_one(
    shape: Shape,
    sweeps: list[str],
    folder: Path,
    recipe: str,
    args: argparse.Namespace,
    dtype: str,
    scratch: Path,
    max_memory: str | None = None,
    timeout_s: float | None = None,
    live: set[subprocess.Popen] | None = None,
) -> dict[str, Any]:
    """One compression run in its own process; the row (status ok, or failed / oom / timeout with the reason).
    ``timeout_s``: the run is killed after this many seconds (a ``--budget-s`` that would be overrun); ``live``:
    the process is in it while it runs (so the caller can stop it)."""
    import yaml

    of = target_of(shape, recipe)
    raw, dropped = scale_recipe(recipe, args.samples, args.seq_len, of)
    weights = shape.params()["total"] * dtype_bytes(dtype)
    row: dict[str, Any] = {
        "id": f"{shape.name}/{recipe}" + ("@offload" if max_memory else ""),
        "shape": shape.name,
        "kind": sweeps[0],
        "sweeps": sweeps,
        "recipe": recipe,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "intermediate": shape.intermediate,
        "family": shape.family,
        "weights_mb": weights / 2**20,
        "layer_params": shape.params()["layers"],
        "of": of,
        "dropped_stages": dropped,
        "max_memory": max_memory,
        "status": "ok",
    }
    name = split_variant(recipe)[0]
    work = Path(tempfile.mkdtemp(prefix=f"{shape.name}-{name}-", dir=scratch))
    try:
        recipe_file = work / f"{name}.yaml"
        recipe_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        out = work / "run"
        flags = ["--model", str(folder), "--device", args.device, "--dtype", dtype, "--no-eval", "--force"]
        command = recipe_run(str(recipe_file), out, flags + (["--max-memory", max_memory] if max_memory else []))
        log_path = work / "run.log"
        start, cpu_before = time.perf_counter(), _children_cpu_s()
        with log_path.open("w") as handle:
            handle.write(shlex.join(command) + "\n")
            handle.flush()
            env = {**os.environ, **OFFLINE_ENV, **QUIET_ENV, "TMPDIR": str(work), **thread_env(args.threads)}
            process = subprocess.Popen(
                via_launcher(command), stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            if live is not None:
                live.add(process)
            try:
                sampled = sample_memory(process, deadline=None if timeout_s is None else start + timeout_s)
            finally:
                if live is not None:
                    live.discard(process)
        done = process
        row["process_wall_s"] = time.perf_counter() - start
        timed_out = bool(sampled.pop("timed_out", False))
        cpu_s = sampled.pop("cpu_s", None)
        row.update(sampled)
        # CPU seconds of the whole process (imports and load included): less sensitive than wall time to
        # other processes on the same cores; the 1-minute load average says how busy the machine was
        row["process_cpu_s"] = cpu_s if cpu_s is not None else _children_cpu_s() - cpu_before
        load = load_average()
        row["load_average_1m"] = load[0] if load else None
        if timed_out:
            reason = f"not finished within {timeout_s:.0f} s (what was left of --budget-s); last output: "
            return {**row, "status": "timeout", "reason": (reason + last_line(log_path))[:400]}
        if done.returncode != 0:
            reason = last_line(log_path)
            status = "oom" if out_of_memory(log_path.read_text(errors="replace")) else "failed"
            if _killed(done.returncode):
                status, reason = "oom", "killed (SIGKILL): out of memory on this machine"
            return {**row, "status": status, "reason": f"exit {done.returncode}: {reason}"[:400]}
        report = read_json_file(out / "report.json", "the run's report")
    finally:
        discard(work)
    stages = {k: v for k, v in (report.get("timings_s") or {}).get("stages", {}).items() if not k.startswith("eval:")}
    compress = sum(v for k, v in stages.items() if k == "calibration" or k[:1].isdigit())
    placement = report.get("placement") or {}
    params = report.get("params") or {}
    row.update(
        {
            "stages_s": stages,
            "load_s": stages.get("load"),
            "calibration_s": stages.get("calibration"),
            "save_s": stages.get("save"),
            "compress_s": compress,
            "s_per_layer": compress / shape.layers,
            "total_s": (report.get("timings_s") or {}).get("total"),
            "peak_rss_mb": report.get("peak_rss_mb"),
            "peak_gpu_mb": placement.get("peak_gpu_mb"),
            "offloaded": placement.get("offloaded"),
            "device": placement.get("device"),
            "dtype": placement.get("dtype"),
            "params_before": params.get("before"),
            "params_after": params.get("after"),
            "achieved": (report.get("target") or {}).get("achieved"),
            "target_met": (report.get("target") or {}).get("met"),
            "calibration": report.get("calibration"),
            "notes": report.get("notes", []),
        }
    )
    return row


def skipped_row(shape: Shape, sweeps: list[str], recipe: str, memory: str | None, dtype: str) -> dict[str, Any]:
    """A row that did not run (status ``skipped``): its shape, recipe and weights, without measurements."""
    row: dict[str, Any] = {"id": f"{shape.name}/{recipe}" + ("@offload" if memory else ""), "shape": shape.name}
    row |= {"kind": sweeps[0], "sweeps": sweeps, "recipe": recipe, "layers": shape.layers, "hidden": shape.hidden}
    return row | {"weights_mb": shape.params()["total"] * dtype_bytes(dtype) / 2**20, "status": "skipped"}
