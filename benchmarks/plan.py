"""A rough time estimate of a grid run before running it: ``python -m benchmarks.run ... --plan``.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file
from benchmarks.core.outputs import RESULTS
from benchmarks.grid import Job, Settings
from benchmarks.grid_rows import ROW_FILE, row_slug

DEFAULT_COMPRESS_S = 300.0
"""A row with no compression time on record (a new recipe)."""

# CPU seconds per example of dense smollm2-135m with one torch thread, for a machine the run has to itself
# (the measurement: docs/methods/benchmark-harness.md, "The plan's constants"). Tasks without a measurement
# are costed as a similar one: arc_challenge and openbookqa as arc_easy, winogrande as piqa, boolq (long
# passages, two choices) as hellaswag.
ZEROSHOT_S_PER_EXAMPLE: dict[str, float] = {
    "piqa": 0.23,
    "hellaswag": 0.62,
    "arc_easy": 0.385,
    "arc_challenge": 0.385,
    "openbookqa": 0.385,
    "boolq": 0.62,
    "winogrande": 0.23,
}
TASK_SIZES: dict[str, int] = {
    "piqa": 1838,
    "hellaswag": 1000,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "openbookqa": 500,
    "boolq": 3270,
    "winogrande": 1267,
}
"""Examples in the shipped data of each task (``primitives/evaluate/zeroshot.py``)."""
PPL_S_PER_1K_TOKENS = 3.7
"""Dense smollm2-135m, 512-token windows, batch 4, one thread (docs/methods/benchmark-harness.md)."""
SPEED_S_PER_ROUND = 6.0
ROW_OVERHEAD_S = 6.0
"""Per row beside compression and evaluation: loading the saved model, counting MACs and widths (the
speed column includes it), with one speed round and one thread (docs/methods/benchmark-harness.md)."""


def history(results: Path = RESULTS) -> dict[tuple[str, float, bool], list[float]]:
    """``(recipe name, ratio, recovery) -> [process wall seconds]`` of every compression on record."""
    found: dict[tuple[str, float, bool], list[float]] = {}
    for path in sorted(results.glob("*.json")):
        try:  # an estimate: a results file that cannot be read (bounded: no FIFO, size, depth) is left out
            rows = read_json_file(path, "a results file").get("rows")
        except BenchError:
            continue
        for row in rows if isinstance(rows, list) else []:
            cost = (row.get("cost") if isinstance(row, dict) else None) or {}
            wall = cost.get("process_wall_s")
            if isinstance(wall, int | float) and not cost.get("reused") and row.get("ratio") is not None:
                key = (str(row.get("recipe")), round(float(row["ratio"]), 6), bool(row.get("recovery")))
                found.setdefault(key, []).append(float(wall))
    return found


def compress_estimate(job: Job, known: dict[tuple[str, float, bool], list[float]]) -> tuple[float, str]:
    """Seconds and where they come from (``"n runs"``, ``"other ratios"`` or ``"?"``)."""
    exact = known.get((job.name, round(job.ratio, 6), job.recovery))
    if exact:
        return statistics.median(exact), f"{len(exact)} run{'s' if len(exact) > 1 else ''}"
    near = [w for (name, _r, ft), walls in known.items() if name == job.name and ft == job.recovery for w in walls]
    if near:
        return statistics.median(near), "other ratios"
    return DEFAULT_COMPRESS_S, "?"


def eval_estimate(settings: Settings) -> float:
    """Seconds to evaluate one model under ``settings`` (dense smollm2-135m's cost)."""
    seconds = len(settings.ppl_datasets) * settings.ppl_tokens / 1000 * PPL_S_PER_1K_TOKENS
    if settings.zeroshot_on:
        for task in settings.zeroshot_tasks:
            size = TASK_SIZES[task]
            examples = size if settings.zeroshot_limit is None else min(settings.zeroshot_limit, size)
            seconds += examples * ZEROSHOT_S_PER_EXAMPLE[task]
    return seconds


def speed_estimate(settings: Settings) -> float:
    """Seconds of one row's speed rounds and loading (:data:`ROW_OVERHEAD_S`)."""
    s = settings.speed
    return ROW_OVERHEAD_S + s.rounds * SPEED_S_PER_ROUND * s.batch * (s.prompt_len + s.new_tokens) / (128 + 32)


def _done(folder: Path, settings: Settings) -> str | None:
    """``"measured"``, ``"compressed"`` or None for a kept run folder."""
    row_file = folder / ROW_FILE
    if os.path.lexists(row_file):
        stored = read_json_file(row_file, "a kept row").get("settings")
        if stored == json.loads(json.dumps(settings.model_dump())):
            return "measured"
    return "compressed" if (folder / "report.json").is_file() else None


def plan_rows(
    settings: Settings, jobs: list[Job], runs: Path | None = None, results: Path = RESULTS
) -> list[dict[str, Any]]:
    """One estimate per row, dense first: ``id, compress_s, eval_s, speed_s, total_s, source``."""
    known = history(results)
    speed = speed_estimate(settings)
    dense_done = runs is not None and _done(runs / "dense", settings) == "measured"
    dense_eval = 0.0 if dense_done else eval_estimate(settings)
    rows: list[dict[str, Any]] = [{"id": "dense", "compress_s": 0.0, "eval_s": dense_eval, "speed_s": 0.0}]
    rows[0]["source"] = "measured in --keep" if dense_done else "-"
    for job in jobs:
        compress, source = compress_estimate(job, known)
        job_settings = settings.for_job(job)
        done = _done(runs / row_slug(job.id), job_settings) if runs is not None else None
        evaluate = eval_estimate(job_settings)
        row: dict[str, Any] = {
            "id": job.id,
            "compress_s": compress,
            "eval_s": evaluate,
            "speed_s": speed,
            "source": source,
        }
        row["zeroshot"] = job_settings.zeroshot_on
        if done == "measured":
            row.update(compress_s=0.0, eval_s=0.0, speed_s=0.0, source="measured in --keep")
        elif done == "compressed":
            row.update(compress_s=0.0, source="compressed in --keep")
        rows.append(row)
    for row in rows:
        row["total_s"] = row["compress_s"] + row["eval_s"] + row["speed_s"]
    return rows


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def plan_text(settings: Settings, rows: list[dict[str, Any]]) -> list[str]:
    zeroshot = (
        f"zero-shot {len(settings.zeroshot_tasks)} tasks x {settings.zeroshot_limit or 'all'} examples"
        if settings.zeroshot_on
        else "no zero-shot"
    )
    lines = [
        f"dense + {len(rows) - 1} rows on {settings.model}: perplexity {len(settings.ppl_datasets)} x "
        f"{settings.ppl_tokens:,} tokens, {zeroshot}, speed {settings.speed.rounds} rounds",
        f"  {'row':<34} {'compress s':>10} {'evaluate s':>10} {'speed s':>8} {'total s':>8}  compress time from",
    ]
    for row in rows:
        skipped = "" if row.get("zeroshot", True) or not settings.zeroshot_on else " (no zero-shot)"
        lines.append(
            f"  {row['id']:<34} {row['compress_s']:>10.0f} {row['eval_s']:>10.0f} {row['speed_s']:>8.0f} "
            f"{row['total_s']:>8.0f}  {row['source']}{skipped}"
        )
    total = {k: sum(r[k] for r in rows) for k in ("compress_s", "eval_s", "speed_s", "total_s")}
    unknown = sum(1 for r in rows if r["source"] == "?")
    guessed = f"; {unknown} rows with no compression time on record counted at {DEFAULT_COMPRESS_S:.0f} s"
    lines.append(
        f"total about {_hours(total['total_s'])} (compress {_hours(total['compress_s'])}, evaluate "
        f"{_hours(total['eval_s'])}, speed {_hours(total['speed_s'])}) with one torch thread on an idle machine"
        + (guessed if unknown else "")
    )
    return lines


def print_plan(settings: Settings, jobs: list[Job], runs: Path | None) -> None:
    print("\n".join(plan_text(settings, plan_rows(settings, jobs, runs))))
