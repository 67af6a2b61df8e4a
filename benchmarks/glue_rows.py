"""The GLUE grid's file and its runs (``python -m benchmarks.glue_grid``): each task model fine-tuned and each
compressed row run by ``slimkit recipe run`` in its own process, reused from a kept folder where it finished.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file, read_yaml_file
from benchmarks.core.processes import QUIET_ENV, last_line, recipe_run, run_logged, thread_env, via_launcher
from benchmarks.grid import pct, read_grid_yaml
from slimkit.primitives.errors import format_validation_error
from slimkit.primitives.settings import Strict

TASKS = ("sst2", "rte", "mrpc", "stsb")
STAGE = "mask_train_encoder"
SETTLE_FRACTION = 0.2
"""The settle gap is the mean |expected sparsity - target| over this last fraction of the mask steps."""


class GlueSettings(Strict):
    tasks: list[str] = Field(default_factory=lambda: list(TASKS), min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    ratios: list[float] = Field(default_factory=lambda: [0.5, 0.7], min_length=1)
    task_model: list[str] = Field(default_factory=list)
    """Extra --set of every task-model run."""
    overrides: list[str] = Field(default_factory=list)
    """Extra --set of every compressed row."""
    mask_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of every row's ``mask_train_encoder`` stage (e.g. the schedule), wherever the recipe puts it."""


class GlueRow(Strict):
    name: str
    recipe: str
    overrides: list[str] = Field(default_factory=list)
    ratios: list[float] | None = None
    """The ratios this row runs at (default: the settings' ratios)."""
    tasks: list[str] | None = None
    """The tasks this row runs on (default: the settings' tasks; a diagnostic row may need one)."""


class GlueClaim(Strict):
    id: str
    claim: str
    source: str
    better: str
    """The row expected to score higher (``better > worse`` on every task's dev metric)."""
    worse: str
    ratios: list[float] | None = None


class GlueGrid(Strict):
    settings: GlueSettings = Field(default_factory=GlueSettings)
    rows: list[GlueRow] = Field(min_length=1)
    claims: list[GlueClaim] = Field(default_factory=list)


def load_glue_grid(path: Path) -> GlueGrid:
    """The GLUE grid file ``path`` validated: known tasks, rows named once, each with one mask stage, claims naming
    rows, ratios in (0, 1)."""
    if not path.is_file():
        raise BenchError(f"--grid: {path} is not a file")
    data = read_grid_yaml(path) or {}
    try:
        grid = GlueGrid.model_validate(data)
    except ValidationError as error:
        raise BenchError(f"{path}: {format_validation_error(error)}") from None
    unknown = [t for t in grid.settings.tasks if t not in TASKS]
    if unknown:
        raise BenchError(f"{path}: settings.tasks: unknown task(s) {unknown}; allowed: {', '.join(TASKS)}")
    for row in grid.rows:
        outside = [t for t in row.tasks or [] if t not in grid.settings.tasks]
        if outside or row.tasks == []:
            what = f"{outside} not among settings.tasks" if outside else "empty"
            raise BenchError(f"{path}: rows.{row.name}.tasks: {what}; allowed: {', '.join(grid.settings.tasks)}")
    names = [row.name for row in grid.rows]
    if len(set(names)) != len(names):
        raise BenchError(f"{path}: rows: names must be unique, got {names}")
    for row in grid.rows:
        try:
            mask_stage_index(row.recipe)
        except Exception as error:
            raise BenchError(f"{path}: rows.{row.name}: {error}") from None
    for claim in grid.claims:
        missing = [n for n in (claim.better, claim.worse) if n not in names]
        if missing:
            raise BenchError(f"{path}: claims.{claim.id}: no row named {missing}")
    for ratio in [*grid.settings.ratios, *(r for row in grid.rows for r in row.ratios or [])]:
        if not 0.0 < ratio < 1.0:
            raise BenchError(f"{path}: ratios must be in (0, 1), got {ratio}")
    return grid


@dataclass(frozen=True)
class RunOptions:
    threads: int | None
    device: str | None
    dtype: str | None
    deadline: float | None
    """time.monotonic() after which no run starts and a running one is stopped."""


def run_recipe(
    recipe: str, folder: Path, sets: list[str], opts: RunOptions
) -> tuple[dict[str, Any] | None, float, str]:
    """``slimkit recipe run`` of ``recipe`` into ``folder`` in its own process (stopped at the deadline); ``(report,
    wall seconds, why it has none)``."""
    flags = ["--force", "--no-dense"] + (["--device", opts.device] if opts.device else [])
    flags += ["--dtype", opts.dtype] if opts.dtype else []
    timeout = None if opts.deadline is None else opts.deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        return None, 0.0, "not started: past the deadline"
    log_path = folder.parent / f"{folder.name}.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    env = {**QUIET_ENV, **thread_env(opts.threads)}
    code, wall = run_logged(via_launcher(recipe_run(recipe, folder, flags, sets)), log_path, env, timeout)
    if code is None:
        return None, wall, "stopped at the deadline"
    if code != 0:
        return None, wall, f"exited with {code}: {last_line(log_path)}"
    try:
        return read_json_file(folder / "report.json", "a run report"), wall, ""
    except BenchError as error:  # a report this code cannot read fails the row, never the grid
        return None, wall, str(error)


def dev_metric(report: dict[str, Any], task: str) -> tuple[str, float] | None:
    """The task's dev metric in a report: Spearman for STS-B, accuracy otherwise (else the first of the task's)."""
    found = [(k, v) for k, v in (report.get("metrics") or {}).items() if k.startswith(f"glue_{task}_")]
    primary = "spearman" if task == "stsb" else "accuracy"
    for key, value in found:
        if key.endswith(primary):
            return key, value
    return found[0] if found else None


def model_id(task: str, seed: int) -> str:
    return f"{task}:task-model#s{seed}"


def row_id(task: str, name: str, ratio: float, seed: int) -> str:
    return f"{task}:{name}@{pct(ratio)}#s{seed}"


def task_model(task: str, seed: int, folder: Path, sets: list[str], opts: RunOptions) -> dict[str, Any]:
    """The task model's row: reused when ``folder`` holds a finished glue-finetune run for ``task`` and ``seed``."""
    report_path, recipe_path = folder / "report.json", folder / "model" / "recipe.yaml"
    wall: float | None = None
    report: dict[str, Any] | None = None
    base = {
        "id": model_id(task, seed),
        "task": task,
        "seed": seed,
        "name": "task-model",
        "device": opts.device or "cpu",
    }
    if report_path.is_file() and recipe_path.is_file() and (folder / "model" / "config.json").is_file():
        try:  # a kept run read with bounds: a hostile file fails this row in one line, never the grid
            recipe = read_yaml_file(recipe_path, "a kept task-model recipe")
            if isinstance(recipe, dict) and recipe.get("task") == task and recipe.get("seed") == seed:
                report = read_json_file(report_path, "a kept task-model report")
        except BenchError as error:
            return {**base, "status": "failed", "reason": str(error), "wall_s": None}
    if report is None:
        report, wall, why = run_recipe("glue-finetune", folder, [f"task={task}", f"seed={seed}", *sets], opts)
        if report is None:
            return {**base, "status": "failed", "reason": why, "wall_s": wall}
    metric = dev_metric(report, task)
    stage = (report.get("stages") or {}).get("glue_finetune", {})
    return {
        **base,
        "recipe": "glue-finetune",
        "status": "ok",
        "metric": metric[0] if metric else None,
        "value": metric[1] if metric else None,
        "params": (report.get("params") or {}).get("after"),
        "finetune_steps": stage.get("steps"),
        "wall_s": wall,
        "model": str(folder / "model"),
    }


def trace_summary(history: dict[str, list[float]] | None, final: float) -> dict[str, Any]:
    """The expected sparsity at every tenth of the mask steps, and its mean gap to ``final`` over the last fifth."""
    values = list((history or {}).get("expected_sparsity") or [])
    if not values:
        return {"trace": None, "settle_gap": None}
    n = len(values)
    trace = [values[min(n - 1, round(n * k / 10) - 1)] for k in range(1, 11)]
    tail = values[n - max(1, round(n * SETTLE_FRACTION)) :]
    return {"trace": trace, "settle_gap": sum(abs(v - final) for v in tail) / len(tail)}


@functools.cache
def mask_stage_index(recipe: str) -> int:
    """Where ``recipe`` runs ``mask_train_encoder`` (its stage index, for ``--set stages.N.args...``)."""
    from slimkit.recipes.loading import load_recipe

    stages = load_recipe(recipe)[1].get("stages") or []
    found = [i for i, stage in enumerate(stages) if isinstance(stage, dict) and stage.get("stage") == STAGE]
    if len(found) != 1:
        raise BenchError(f"recipe {recipe}: needs exactly one {STAGE} stage, has {len(found)}")
    return found[0]


def compressed_row(
    task: str,
    row: GlueRow,
    ratio: float,
    seed: int,
    model: str,
    keep: Path,
    extra: list[str],
    mask_args: dict[str, Any],
    opts: RunOptions,
) -> dict[str, Any]:
    rid = row_id(task, row.name, ratio, seed)
    out: dict[str, Any] = {"id": rid, "task": task, "name": row.name, "recipe": row.recipe, "ratio": ratio}
    out.update(seed=seed, device=opts.device or "cpu", status="ok")
    # Not strict: a row whose masks overshoot the target is measured and flagged (report target.met).
    sets = [f"model={model}", f"task={task}", f"seed={seed}", f"target.ratio={ratio}", "target.strict=false"]
    index = mask_stage_index(row.recipe)
    sets += ["stages.0.args.max_steps=0", *extra]
    sets += [f"stages.{index}.args.{key}={json.dumps(value)}" for key, value in mask_args.items()]
    sets += row.overrides
    out["overrides"] = sets
    folder = keep / rid.replace(":", "-").replace("@", "-r").replace("#", "-")
    report, wall, error = run_recipe(row.recipe, folder, sets, opts)
    out["wall_s"] = wall
    if report is None:
        return {**out, "status": "failed", "reason": error}
    metric = dev_metric(report, task)
    stage = (report.get("stages") or {}).get(STAGE, {})
    fused = stage.get("fused") or {}
    out.update(
        {
            "metric": metric[0] if metric else None,
            "value": metric[1] if metric else None,
            "params": (report.get("params") or {}).get("after"),
            "binary_sparsity": stage.get("binary_sparsity"),
            "achieved_sparsity": stage.get("achieved_sparsity"),
            "counted_weights": stage.get("counted_weights"),
            "expected_sparsity_last": stage.get("expected_sparsity_last"),
            "lambda_1": stage.get("lambda_1"),
            "lambda_2": stage.get("lambda_2"),
            "mask_steps": stage.get("steps"),
            "mask_s": stage.get("seconds"),
            "seconds_per_step": stage.get("seconds_per_step"),
            "masked_vs_fused": fused.get("masked_vs_fused"),
            "placeholder_params": fused.get("placeholder_params"),
            **trace_summary(stage.get("history"), ratio),
        }
    )
    return out
