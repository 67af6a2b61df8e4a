"""The processes a benchmark starts (``slimkit recipe run`` in its own process, its log, its environment) and the
machine it runs on.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUIET_ENV = {"TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # lm-eval's progress bars, per row
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def via_launcher(command: list[str]) -> list[str]:
    """``command`` started by a small Python launcher. Linux carries the forking process's peak RSS into an exec'd
    child's ``ru_maxrss`` (what a run's report states as its peak); the benchmark may hold a model, the launcher
    holds almost nothing, so the number becomes the run's own."""
    return [sys.executable, "-c", LAUNCHER, *command]


def recipe_run(recipe: str, out: Path, flags: Sequence[str] = (), sets: Sequence[str] = ()) -> list[str]:
    """The ``slimkit recipe run RECIPE --out OUT FLAGS --set S...`` command, run by this Python."""
    command = [sys.executable, "-m", "slimkit.cli.main", "recipe", "run", recipe, "--out", str(out), *flags]
    return command + [item for assignment in sets for item in ("--set", assignment)]


def thread_env(threads: int | None) -> dict[str, str]:
    """The OpenMP / MKL thread count of a started process (empty: theirs)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_logged(
    command: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float | None = None
) -> tuple[int | None, float]:
    """Run ``command`` with its output (after the command line itself) in ``log_path``; ``(exit status or None when
    stopped at ``timeout`` seconds, wall seconds)``. The environment is this one, offline, plus ``env``."""
    start = time.perf_counter()
    with Path(log_path).open("w") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        try:
            done = subprocess.run(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV, **(env or {})},
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return None, time.perf_counter() - start
    return done.returncode, time.perf_counter() - start


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def last_line(path: Path) -> str:
    """The last error line (else the last line) of a run's log, cut to 300 characters."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln.startswith(("error:", "Error", "RuntimeError", "ValueError"))]
    return (errors or lines or ["no output"])[-1][:300]


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def gpu_info() -> dict[str, Any]:
    """The current CUDA device as a run report describes it: ``gpu`` (name), ``gpu_memory_gib``, ``cuda``."""
    import torch

    from slimkit.primitives.device.placement import Placement

    described = Placement(torch.device("cuda", torch.cuda.current_device()), torch.float32).describe()
    return {key: described[key] for key in ("gpu", "gpu_memory_gib", "cuda")}


def machine_info() -> dict[str, Any]:
    """The machine a benchmark runs on: GPU, CPU, cores, memory, torch threads, platform, Python, load average."""
    import psutil
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "gpu": gpu_info() if torch.cuda.is_available() else None,
        "cpu": cpu or "unknown CPU",
        "cores": os.cpu_count(),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_start": load_average(),
    }
