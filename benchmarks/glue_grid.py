"""The BERT/GLUE grid: SP3's BERT recipe against the CoFi-style masks-only baseline, with seeds.

``python -m benchmarks.glue_grid --grid benchmarks/grid-glue.yaml``.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from benchmarks.claims import NOT_RUN, compare, describe
from benchmarks.grid import BenchError, pct, read_grid_yaml
from benchmarks.inputs import OneLineParser, check_folder_option, read_json_file, read_yaml_file
from benchmarks.run import OFFLINE_ENV, QUIET_ENV, last_line, machine_info, via_launcher
from slimkit.primitives.errors import format_validation_error
from slimkit.primitives.settings import Strict

RESULTS = Path(__file__).parent / "results"
GRID_FILE = Path(__file__).parent / "grid-glue.yaml"
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


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m benchmarks.glue_grid", description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=GRID_FILE, help="the grid file (default grid-glue.yaml)")
    parser.add_argument("--tasks", default=None, help="only these tasks (comma-separated; default: the grid's)")
    parser.add_argument("--seeds", default=None, help="only these seeds (comma-separated; default: the grid's)")
    parser.add_argument("--ratios", default=None, help="only these ratios (comma-separated, e.g. 0.7)")
    parser.add_argument("--rows", default=None, help="only these rows, in this order (comma-separated; default: all)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra --set for every row")
    parser.add_argument(
        "--order",
        choices=("seed", "row"),
        default="seed",
        help="seed: seed by seed (default); row: row by row, every seed of a row together",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time (use with --threads 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of every run")
    parser.add_argument("--device", default=None, help="--device of every run (e.g. cuda)")
    parser.add_argument("--dtype", default=None, help="--dtype of every run (e.g. float32)")
    parser.add_argument("--deadline-s", type=float, default=None, help="no job starts after it; running ones stop")
    parser.add_argument(
        "--reuse", type=Path, default=None, help="an earlier results .json of this grid: its finished rows are kept"
    )
    parser.add_argument("--rerun", default=None, help="with --reuse: these row ids run again (comma-separated)")
    parser.add_argument("--task-models", type=Path, default=Path("runs/glue-task-models"), help="task-model runs")
    parser.add_argument("--keep", type=Path, default=Path("runs/bench-glue"), help="folder of the row runs")
    parser.add_argument("--name", default="glue", help="results are OUT/<date>-<name>.*")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


@dataclass(frozen=True)
class RunOptions:
    threads: int | None
    device: str | None
    dtype: str | None
    deadline: float | None
    """time.monotonic() after which no run starts and a running one is stopped."""


def _run(recipe: str, folder: Path, sets: list[str], opts: RunOptions) -> tuple[dict[str, Any] | None, float, str]:
    command = [sys.executable, "-m", "slimkit.cli.main", "recipe", "run", recipe, "--out", str(folder), "--force"]
    command += ["--no-dense"] + (["--device", opts.device] if opts.device else [])
    command += ["--dtype", opts.dtype] if opts.dtype else []
    command = via_launcher(command + [x for s in sets for x in ("--set", s)])
    env = {**os.environ, **OFFLINE_ENV, **QUIET_ENV}
    if opts.threads is not None:
        env.update(OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads))
    timeout = None if opts.deadline is None else opts.deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        return None, 0.0, "not started: past the deadline"
    log_path = folder.parent / f"{folder.name}.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("w") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        try:
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.perf_counter() - start, "stopped at the deadline"
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return None, wall, f"exited with {done.returncode}: {last_line(log_path)}"
    return json.loads((folder / "report.json").read_text()), wall, ""


def _metric(report: dict[str, Any], task: str) -> tuple[str, float] | None:
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
    wall = None
    report = None
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
        report, wall, error = _run("glue-finetune", folder, [f"task={task}", f"seed={seed}", *sets], opts)
        if report is None:
            return {**base, "status": "failed", "reason": error, "wall_s": wall}
    metric = _metric(report, task)
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
    report, wall, error = _run(row.recipe, folder, sets, opts)
    out["wall_s"] = wall
    if report is None:
        return {**out, "status": "failed", "reason": error}
    metric = _metric(report, task)
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


# -- aggregation and claims --------------------------------------------------------------------------------
def finished(rows: list[dict[str, Any]], task: str, name: str, ratio: float | None) -> list[dict[str, Any]]:
    """The finished seeds of one row at one ratio (``ratio`` None: the task models)."""
    return [
        r
        for r in rows
        if r.get("status") == "ok"
        and r.get("value") is not None
        and r.get("task") == task
        and r.get("name") == name
        and (ratio is None or abs(r.get("ratio", -1.0) - ratio) < 1e-9)
    ]


def draws(rows: list[dict[str, Any]], task: str, name: str, ratio: float | None) -> list[float]:
    """The finished seeds' dev metric of one row at one ratio (``ratio`` None: the task models)."""
    return [r["value"] for r in finished(rows, task, name, ratio)]


def seed_gains(rows: list[dict[str, Any]], task: str, better: str, worse: str, ratio: float) -> list[float]:
    """``better - worse`` for every seed where both finished (both start from that seed's task model)."""
    a, b = ({r["seed"]: r["value"] for r in finished(rows, task, name, ratio)} for name in (better, worse))
    return [a[seed] - b[seed] for seed in sorted(a.keys() & b.keys())]


def decide_claims(
    rows: list[dict[str, Any]], grid: GlueGrid, tasks: list[str], seeds: int | None = None
) -> list[dict[str, Any]]:
    """Every claim per task and ratio over the seeds' pairings, plus SP3's "most on small data": SP3's gain over CoFi
    per seed (both from that seed's task model) on RTE against SST-2, every pairing of gains over both ratios.

    A verdict from fewer draws than ``seeds`` (default: the grid's seeds) on either side is marked ``provisional``
    (``"1 of 3 seeds"``): one pairing of single draws is not a decision."""
    wanted = seeds or len(grid.settings.seeds)
    ratios_of = {row.name: row.ratios or grid.settings.ratios for row in grid.rows}
    decided: list[dict[str, Any]] = []
    gains: dict[str, list[float]] = {}
    partial: set[str] = set()
    for claim in grid.claims:
        for task in tasks:
            for ratio in claim.ratios or ratios_of[claim.better]:
                a, b = draws(rows, task, claim.better, ratio), draws(rows, task, claim.worse, ratio)
                label_a, label_b = f"{claim.better}@{pct(ratio)}", f"{claim.worse}@{pct(ratio)}"
                entry = {
                    "id": f"{claim.id}:{task}@{pct(ratio)}",
                    "claim": claim.claim,
                    "source": claim.source,
                    "task": task,
                    "ratio": ratio,
                }
                if not a or not b:
                    decided.append(
                        {
                            **entry,
                            "verdict": NOT_RUN,
                            "evidence": f"{label_a}: {len(a)} seeds, {label_b}: {len(b)} seeds",
                        }
                    )
                    continue
                verdict, held = compare(">", a, 1.0, b)
                gap = sum(a) / len(a) - sum(b) / len(b)
                if claim.id == "sp3-vs-cofi":
                    gains.setdefault(task, []).extend(seed_gains(rows, task, claim.better, claim.worse, ratio))
                evidence = f"{describe(label_a, a)} > {describe(label_b, b)}: {held} of {len(a) * len(b)} pairings"
                entry |= {"verdict": verdict, "gap": gap, "evidence": evidence}
                if min(len(a), len(b)) < wanted:
                    entry["provisional"] = f"{min(len(a), len(b))} of {wanted} seeds"
                    if claim.id == "sp3-vs-cofi":
                        partial.add(task)
                decided.append(entry)
    if any(c.id == "sp3-vs-cofi" for c in grid.claims):
        if gains.get("rte") and gains.get("sst2"):
            rte, sst2 = gains["rte"], gains["sst2"]
            verdict, held = compare(">", rte, 1.0, sst2)
            evidence = (
                f"per-seed gain rte {sum(rte) / len(rte):+.4f} ({len(rte)} seed x ratio) vs sst2 "
                f"{sum(sst2) / len(sst2):+.4f} ({len(sst2)}): {held} of {len(rte) * len(sst2)} pairings"
            )
        else:
            verdict, evidence = NOT_RUN, "needs rte and sst2 rows"
        small_data = {
            "id": "sp3-gain-small-data",
            "claim": "the PCA projection helps most on small datasets (RTE more than SST-2)",
            "source": "SP3, Tables 2/3",
            "verdict": verdict,
            "evidence": evidence,
        }
        if verdict != NOT_RUN and partial & {"rte", "sst2"}:
            small_data["provisional"] = f"fewer than {wanted} seeds on {', '.join(sorted(partial & {'rte', 'sst2'}))}"
        decided.append(small_data)
    return decided


def _device(row: dict[str, Any], result: dict[str, Any]) -> str:
    """Where ``row`` ran (a row of an older results file: the file's device)."""
    return row.get("device") or result.get("device") or "cpu"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f} (1 seed)"
    return f"{_mean(values):.4f} [{min(values):.4f}-{max(values):.4f}]"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"# GLUE grid: {result['name']} ({result['date']})",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine'].get('cpu', '?')}, {result['machine'].get('cores', '?')} cores"
        f"{', ' + result['device'] if result.get('device') else ''}; wall {result.get('wall_s', 0):.0f} s."
        + (
            f" Finished rows reused from `{result['reused_from']}` (the device of each run is in the last table)."
            if result.get("reused_from")
            else ""
        ),
        "",
        "Dev metric (accuracy; STS-B: Spearman) as mean [min-max] over the seeds that finished (with the seeds per "
        "device where they ran on more than one; seconds are then means over devices). Sparsity: Eq. 30 of the binary "
        "masks. Settle gap: mean |expected sparsity - target| over the last fifth of the mask steps.",
        "",
        "| task | row | seeds | dev metric | Eq. 30 sparsity | settle gap | mask steps | s/step | wall s |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups: dict[tuple[str, str, float | None], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row.get("name", "?"), row.get("ratio")), []).append(row)
    for (task, name, ratio), members in groups.items():
        ok = [m for m in members if m.get("status") == "ok" and m.get("value") is not None]
        label = name if ratio is None else f"{name}@{pct(ratio)}"

        def avg(key: str, members: list[dict[str, Any]] = ok) -> float | None:
            return _mean([m[key] for m in members if m.get(key) is not None])

        devices = [_device(m, result) for m in ok]
        mixed = (
            f" ({', '.join(f'{d} {devices.count(d)}' for d in sorted(set(devices)))})" if len(set(devices)) > 1 else ""
        )
        lines.append(
            f"| {task} | {label} | {len(ok)}/{len(members)}{mixed} | {_spread([m['value'] for m in ok])} | "
            f"{_fmt(avg('binary_sparsity'), '.2%')} | {_fmt(avg('settle_gap'), '.3f')} | "
            f"{_fmt(avg('mask_steps'), '.0f')} | {_fmt(avg('seconds_per_step'), '.3f')} | "
            f"{_fmt(avg('wall_s'), '.0f')} |"
        )
    lines += ["", "## Claims", "", "| claim | source | task | verdict | evidence |", "| --- | --- | --- | --- | --- |"]
    for claim in result["claims"]:
        task = claim.get("task", "-")
        where = task if claim.get("ratio") is None else f"{task} @ {pct(claim['ratio'])}%"
        provisional = f" (provisional: {claim['provisional']})" if "provisional" in claim else ""
        verdict = f"**{claim['verdict']}**{provisional}"
        lines.append(f"| {claim['claim']} | {claim['source']} | {where} | {verdict} | {claim.get('evidence', '')} |")
    lines += [
        "",
        "## Every run",
        "",
        "| run | device | dev metric | Eq. 30 sparsity | expected sparsity at every tenth of the mask steps | "
        "masked = fused | status |",
        "| --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        trace = " ".join(f"{v:.2f}" for v in row.get("trace") or []) or "-"
        agreement = (row.get("masked_vs_fused") or {}).get("prediction_agreement")
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason', '')}"
        lines.append(
            f"| {row['id']} | {_device(row, result)} | {_fmt(row.get('value'), '.4f')} | "
            f"{_fmt(row.get('binary_sparsity'), '.2%')} | {trace} | "
            f"{_fmt(agreement, '.3f')} | {status} |"
        )
    return "\n".join(lines) + "\n"


# -- the run ------------------------------------------------------------------------------------------------
def job_id(job: tuple[Any, ...]) -> str:
    return model_id(job[1], job[2]) if job[0] == "model" else row_id(job[1], job[3], job[4], job[2])


def reused_rows(
    path: Path, jobs: list[tuple[Any, ...]], rerun: frozenset[str] = frozenset()
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The jobs an earlier results file finished: compressed rows with status ok, and task models whose folder still
    holds the model or whose rows are all finished (a task model that is gone is trained again only when a row still
    needs it; rows whose id is in ``rerun`` are not kept). Each kept row records the device it ran on (an older file's
    rows: the file's ``device``)."""
    if not path.is_file():
        raise BenchError(f"--reuse: {path} is not a file")
    data = read_json_file(path, "--reuse")
    try:
        earlier = {row["id"]: {"device": data.get("device") or "cpu", **row} for row in data.get("rows", [])}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise BenchError(f"--reuse: {path} is not a glue_grid results file ({error})") from None
    finished = {job: earlier[job_id(job)] for job in jobs if earlier.get(job_id(job), {}).get("status") == "ok"}
    kept = {job: row for job, row in finished.items() if job[0] == "row" and job_id(job) not in rerun}
    to_run = {job[1:3] for job in jobs if job[0] == "row" and job not in kept}  # (task, seed) of rows still to run
    for job, row in finished.items():
        if job[0] == "model" and (job[1:3] not in to_run or (Path(row.get("model") or "") / "config.json").is_file()):
            kept[job] = row
    return kept


def job_list(
    grid: GlueGrid, tasks: list[str], seeds: list[int], rows: list[GlueRow], ratios: list[float], order: str
) -> list[tuple[Any, ...]]:
    """The jobs in the order they start: ``("model", task, seed)`` and ``("row", task, seed, name, ratio)``.

    ``seed``: seed by seed, that seed's task models first, then its rows (a run stopped at a deadline leaves whole
    seeds). ``row``: every task model first, then row by row in the order of ``rows``, each row's ratios, tasks and
    seeds together (a run stopped at a deadline leaves whole claims: every seed of the rows it reached). A row starts
    only once its task model has finished, whatever the order."""
    cells = [(row, ratio) for row in rows for ratio in row.ratios or grid.settings.ratios if ratio in ratios]

    def runs(row: GlueRow, task: str) -> bool:
        return row.tasks is None or task in row.tasks

    if order == "row":
        models: list[tuple[Any, ...]] = [("model", task, seed) for task in tasks for seed in seeds]
        return models + [
            ("row", t, s, row.name, ratio) for row, ratio in cells for t in tasks if runs(row, t) for s in seeds
        ]
    jobs: list[tuple[Any, ...]] = []
    for seed in seeds:
        jobs += [("model", task, seed) for task in tasks]
        jobs += [("row", task, seed, row.name, ratio) for task in tasks for row, ratio in cells if runs(row, task)]
    return jobs


def _csv(text: str | None, cast: type, allowed: list[Any], what: str) -> list[Any] | None:
    if text is None:
        return None
    try:
        values = [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--{what}: '{text}' is not a comma-separated list") from None
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise BenchError(f"--{what}: unknown or none {bad}; allowed: {', '.join(map(str, allowed))}")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        check_folder_option("--out", args.out, "the results")
        check_folder_option("--keep", args.keep, "the row runs")
        check_folder_option("--task-models", args.task_models, "the task-model runs")
        grid = load_glue_grid(args.grid)
        tasks = _csv(args.tasks, str, grid.settings.tasks, "tasks") or grid.settings.tasks
        seeds = _csv(args.seeds, int, grid.settings.seeds, "seeds") or grid.settings.seeds
        all_ratios = sorted({*grid.settings.ratios, *(r for row in grid.rows for r in row.ratios or [])})
        only = _csv(args.ratios, float, all_ratios, "ratios") or all_ratios
        names = _csv(args.rows, str, [r.name for r in grid.rows], "rows") or [r.name for r in grid.rows]
        if args.threads is not None and args.threads < 1:
            raise BenchError(f"--threads must be at least 1, got {args.threads}")
        if args.jobs < 1:
            raise BenchError(f"--jobs must be at least 1, got {args.jobs}")
        if args.deadline_s is not None and args.deadline_s <= 0:
            raise BenchError(f"--deadline-s must be > 0, got {args.deadline_s}")
        rows = sorted((r for r in grid.rows if r.name in names), key=lambda r: names.index(r.name))
        jobs = job_list(grid, tasks, seeds, rows, only, args.order)
        if args.rerun is not None and args.reuse is None:
            raise BenchError("--rerun needs --reuse")
        rerun = _csv(args.rerun, str, [job_id(j) for j in jobs if j[0] == "row"], "rerun") or []
        done = reused_rows(args.reuse, jobs, frozenset(rerun)) if args.reuse else {}
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from slimkit.primitives.io import versions

    start = time.perf_counter()
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    opts = RunOptions(args.threads, args.device, args.dtype, deadline)
    base = args.out / f"{dt.date.today().isoformat()}-{args.name}"
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "name": args.name,
        "date": dt.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.glue_grid", *argv]),
        "machine": machine_info(),
        "device": args.device,
        "versions": versions(),
        "grid": grid.model_dump(),
        "rows": [],
        "claims": [],
    }
    if done:
        result["reused_from"] = str(args.reuse)
        print(f"reusing {len(done)} finished rows of {args.reuse}", flush=True)
    lock = threading.Condition()
    pending = [job for job in jobs if job not in done]

    def write() -> None:
        result["wall_s"] = time.perf_counter() - start
        result["rows"] = [done[j] for j in jobs if j in done]
        result["claims"] = decide_claims(result["rows"], grid, tasks, len(seeds))
        base.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        base.with_suffix(".md").write_text(markdown(result))

    def ready(job: tuple[Any, ...]) -> bool:
        return job[0] == "model" or ("model", job[1], job[2]) in done

    def execute(job: tuple[Any, ...]) -> dict[str, Any]:
        if job[0] == "model":
            _, task, seed = job
            return task_model(task, seed, args.task_models / f"{task}-s{seed}", grid.settings.task_model, opts)
        _, task, seed, name, ratio = job
        row = next(r for r in rows if r.name == name)
        model = done[("model", task, seed)]
        if model["status"] != "ok":
            base_row = {"id": row_id(task, row.name, ratio, seed), "task": task, "name": row.name, "ratio": ratio}
            return {**base_row, "seed": seed, "status": "failed", "reason": f"task model: {model.get('reason')}"}
        extra = [*grid.settings.overrides, *args.overrides]
        return compressed_row(task, row, ratio, seed, model["model"], args.keep, extra, grid.settings.mask_args, opts)

    def worker() -> None:
        while True:
            with lock:
                while pending and not any(ready(j) for j in pending):
                    lock.wait()
                if not pending:
                    return
                job = next(j for j in pending if ready(j))
                pending.remove(job)
            out = execute(job)
            print(f"{out['id']}: {out.get('value')} ({out['status']}, {out.get('wall_s') or 0:.0f} s)", flush=True)
            with lock:
                done[job] = out
                write()
                lock.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    write()
    print(f"wrote {base}.json, {base}.md in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
