"""Run the benchmark grid: every recipe x target ratio x recovery setting, side by side, in one command.

    python -m benchmarks.run                       # the full grid of benchmarks/grid.yaml (hours)
    python -m benchmarks.run --quick               # the smoke-sized grid (minutes)

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import RESULTS, dated_base, write_results
from benchmarks.core.processes import load_average, log, machine_info
from benchmarks.grid import (
    GRID_FILE,
    GridFile,
    Job,
    Settings,
    expand,
    load_grid,
    parse_ratios,
    resolve_settings,
    select_entries,
)
from benchmarks.seeds import add_norm_mean, seed_groups


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.run", __doc__)
    parser.add_argument("--quick", action="store_true", help="the smoke-sized grid and budgets of grid.yaml")
    parser.add_argument("--only", type=arg.names, help="comma-separated recipes to run (dense always runs)")
    parser.add_argument("--ratios", help="comma-separated target ratios, 0.2 or 20 (narrows each entry's ratios)")
    parser.add_output_folder(
        "--out", "the results", default=RESULTS, help="results folder (default benchmarks/results)"
    )
    parser.add_argument("--name", type=arg.file_name, help="results are OUT/<date>-<name>.*; default 'grid' or 'quick'")
    parser.add_argument("--ppl-tokens", type=arg.integer(2), help="perplexity token budget per dataset")
    parser.add_argument("--zeroshot-limit", type=arg.integer(0), help="examples per zero-shot task (0 skips zero-shot)")
    parser.add_argument("--zeroshot-tasks", help="comma-separated zero-shot tasks ('' skips zero-shot)")
    parser.add_argument("--speed-rounds", type=arg.integer(1), help="interleaved speed rounds per row")
    parser.add_argument(
        "--device", type=arg.device_name, help="compress and evaluate every row on: auto (default), cpu, cuda, cuda:N"
    )
    parser.add_argument("--dtype", type=arg.dtype_name, help="the weights' dtype: auto, float32, bfloat16, float16")
    parser.add_argument(
        "--threads", type=arg.integer(1), help="torch threads here and in the compression processes (default: torch's)"
    )
    parser.add_argument("--grid", type=Path, default=GRID_FILE, help="grid file (default benchmarks/grid.yaml)")
    parser.add_output_folder("--keep", "the kept runs", help="keep every run folder under this folder")
    parser.add_argument("--resume", action="store_true", help="with --keep: reuse finished runs found there")
    parser.add_argument(
        "--reuse-only",
        action="store_true",
        help="with --resume: only collect rows measured earlier (others become 'not run'); assembles a grid "
        "measured by several processes or sessions",
    )
    parser.add_argument("--list", action="store_true", help="print the rows that would run, and exit")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the rows that would run with a rough cost each (compress + evaluate + speed), and exit; "
        "with --keep/--resume, rows already done there cost nothing",
    )
    return parser


def plan(args: argparse.Namespace) -> tuple[GridFile, Settings, list[Job]]:
    """The grid, its settings and its rows, every option checked (one line for the first bad one)."""
    grid = load_grid(args.grid)
    cli = {
        "ppl_tokens": args.ppl_tokens,
        "zeroshot_limit": args.zeroshot_limit,
        "zeroshot_tasks": None if args.zeroshot_tasks is None else [t for t in args.zeroshot_tasks.split(",") if t],
        "speed": None if args.speed_rounds is None else {"rounds": args.speed_rounds},
        "device": args.device,
        "dtype": args.dtype,
    }
    settings = resolve_settings(grid, args.quick, cli)
    entries = grid.quick.grid if args.quick else grid.grid
    ratios = parse_ratios(args.ratios) if args.ratios is not None else None
    jobs = expand(select_entries(entries, args.only), settings, ratios)
    if args.reuse_only and not args.resume:
        raise BenchError("--reuse-only needs --resume (and --keep DIR)")
    if args.resume and args.keep is None:
        raise BenchError("--resume needs --keep DIR (the folder whose runs it reuses)")
    return grid, settings, jobs


def write_result(result: dict[str, Any], base: Path, plots: bool) -> list[Path]:
    """``BASE.json`` and ``BASE.md`` of ``result`` and, with ``plots``, the quality and width plots beside them."""
    from benchmarks.grid_plots import plot_quality, plot_widths
    from benchmarks.tables import markdown

    written: list[Path] = []
    if plots:
        quality = plot_quality(result["rows"], base.parent / f"{base.name}-quality.png")
        written = ([quality] if quality else []) + plot_widths(result["rows"], base)
    write_results(base, result, markdown(result, [str(p) for p in written]))
    return written


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every row of the grid measured beside dense, the results rewritten after each row and the plots at the end."""
    import torch

    from benchmarks.claims import evaluate_claims
    from benchmarks.core.engine_calls import peak_rss_mb
    from benchmarks.grid_rows import Bench, eval_config
    from slimkit.primitives.evaluate.run import preflight_eval_data
    from slimkit.primitives.io import versions

    grid, settings, jobs = plan(args)
    name = args.name or ("quick" if args.quick else "grid")
    preflight_eval_data(eval_config(settings))
    args.out.mkdir(parents=True, exist_ok=True)
    base = dated_base(args.out, name)
    start = time.perf_counter()
    result: dict[str, Any] = {
        "name": name,
        "date": dt.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.run", *argv]),
        "machine": machine_info(),
        "versions": versions(),
        "settings": settings.model_dump(),
        "rows": [],
        "seed_groups": [],
        "claims": [],
    }
    with tempfile.TemporaryDirectory(prefix="slimkit-bench-") as scratch:
        runs = args.keep or Path(scratch)
        runs.mkdir(parents=True, exist_ok=True)
        log(f"{len(jobs)} rows + dense; runs in {runs}; results {base}.*")
        bench = Bench(settings, runs, args.keep is not None, args.resume, args.threads, args.reuse_only)
        result["machine"]["torch_threads"] = torch.get_num_threads()
        dense = bench.kept_dense_row()
        add_norm_mean(dense.get("metrics") or {})  # a dense row stored before the mean existed
        result["rows"].append(dense)
        log(f"[dense] {summary(dense)}")
        for index, job in enumerate(jobs, 1):
            log(f"[{index}/{len(jobs)}] {job.id} ...")
            job_start = time.perf_counter()
            row = bench.run_job(job)
            row["bench_s"] = time.perf_counter() - job_start
            add_norm_mean(row.get("metrics") or {})  # rows reused from before the mean existed
            result["rows"].append(row)
            log(f"[{index}/{len(jobs)}] {job.id}: {summary(row)} ({row['bench_s']:.0f} s)")
            result["wall_s"] = time.perf_counter() - start
            result["seed_groups"] = seed_groups(result["rows"])
            result["claims"] = evaluate_claims(grid.claims, result["rows"])
            write_result(result, base, plots=False)
        bench.finish_dense(dense)
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_end"] = load_average()
    result["bench_peak_rss_mb"] = peak_rss_mb()  # this process: the dense model, one row's model, evaluation
    result["seed_groups"] = seed_groups(result["rows"])
    result["claims"] = evaluate_claims(grid.claims, result["rows"])
    plots = write_result(result, base, plots=True)
    log(f"wrote {base}.json, {base}.md" + "".join(f", {p.name}" for p in plots) + f" in {result['wall_s']:.0f} s")
    return result


def summary(row: dict[str, Any]) -> str:
    """One row as the progress log shows it: what was removed and the quality, or why it did not run."""
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason')}"
    metrics = ", ".join(
        f"{k} {v:.4g}" for k, v in row.get("metrics", {}).items() if k.endswith(("_ppl", "mean_acc", "mean_acc_norm"))
    )
    removed = row.get("params", {}).get("removed_ratio")
    return f"params removed {removed:.2%}, {metrics}" if removed is not None else metrics


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    if args.plan:
        from benchmarks.plan import print_plan

        _grid, settings, jobs = plan(args)
        print_plan(settings, jobs, args.keep if args.resume else None)
        return
    if args.list:
        _grid, settings, jobs = plan(args)
        print(f"dense + {len(jobs)} rows on {settings.model}:")
        for job in jobs:
            print(f"  {job.id}" + (f"  ({', '.join(job.overrides)})" if job.overrides else ""))
        return
    run(args, argv)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
