"""The BERT/GLUE grid: SP3's BERT recipe against the CoFi-style masks-only baseline, with seeds.

``python -m benchmarks.glue_grid --grid benchmarks/grid-glue.yaml``.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import datetime as dt
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file
from benchmarks.core.outputs import RESULTS, dated_base, write_results
from benchmarks.core.processes import machine_info
from benchmarks.glue_report import decide_claims, markdown
from benchmarks.glue_rows import (
    GlueGrid,
    GlueRow,
    RunOptions,
    compressed_row,
    load_glue_grid,
    model_id,
    row_id,
    task_model,
)

GRID_FILE = Path(__file__).parent / "grid-glue.yaml"


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.glue_grid", __doc__)
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
    parser.add_argument("--jobs", type=arg.integer(1), default=1, help="runs at the same time (use with --threads 1)")
    parser.add_argument("--threads", type=arg.integer(1), default=None, help="torch threads of every run")
    parser.add_argument("--device", type=arg.device, default=None, help="--device of every run (e.g. cuda)")
    parser.add_argument("--dtype", type=arg.dtype_name, default=None, help="--dtype of every run (e.g. float32)")
    parser.add_argument(
        "--deadline-s", type=arg.positive, default=None, help="no job starts after it; running ones stop"
    )
    parser.add_argument(
        "--reuse", type=Path, default=None, help="an earlier results .json of this grid: its finished rows are kept"
    )
    parser.add_argument("--rerun", default=None, help="with --reuse: these row ids run again (comma-separated)")
    parser.add_output_folder(
        "--out", "the results", default=RESULTS, help="results folder (default benchmarks/results)"
    )
    parser.add_output_folder("--keep", "the row runs", default=Path("runs/bench-glue"), help="folder of the row runs")
    parser.add_output_folder(
        "--task-models", "the task-model runs", default=Path("runs/glue-task-models"), help="task-model runs"
    )
    parser.add_argument("--name", type=arg.file_name, default="glue", help="results are OUT/<date>-<name>.*")
    return parser


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


def subset(text: str | None, cast: Callable[[str], Any], allowed: list[Any], what: str) -> list[Any] | None:
    """The comma-separated ``text`` as values of ``allowed`` (None when not given); one line otherwise."""
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


def main_body(argv: list[str]) -> None:
    from slimkit.recipes.loading import load_recipe

    args = build_parser().parse(argv)
    grid = load_glue_grid(args.grid)
    tasks = subset(args.tasks, str, grid.settings.tasks, "tasks") or grid.settings.tasks
    seeds = subset(args.seeds, int, grid.settings.seeds, "seeds") or grid.settings.seeds
    all_ratios = sorted({*grid.settings.ratios, *(r for row in grid.rows for r in row.ratios or [])})
    only = subset(args.ratios, float, all_ratios, "ratios") or all_ratios
    names = subset(args.rows, str, [r.name for r in grid.rows], "rows") or [r.name for r in grid.rows]
    rows = sorted((r for r in grid.rows if r.name in names), key=lambda r: names.index(r.name))
    for row in rows:  # a bad --set is one line before any run
        load_recipe(row.recipe, [*grid.settings.overrides, *args.overrides, *row.overrides])
    jobs = job_list(grid, tasks, seeds, rows, only, args.order)
    if args.rerun is not None and args.reuse is None:
        raise BenchError("--rerun needs --reuse")
    rerun = subset(args.rerun, str, [job_id(j) for j in jobs if j[0] == "row"], "rerun") or []
    done = reused_rows(args.reuse, jobs, frozenset(rerun)) if args.reuse else {}
    from slimkit.primitives.io import versions

    start = time.perf_counter()
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    opts = RunOptions(args.threads, args.device, args.dtype, deadline)
    base = dated_base(args.out, args.name)
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
        write_results(base, result, markdown(result))

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


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
