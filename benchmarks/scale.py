"""How compression cost grows with model size: random-weight models of real shapes, cost only.

    python -m benchmarks.scale                      # the real shapes + depth/width sweeps + offload rows
    python -m benchmarks.scale --quick              # tiny shapes only (the smoke test; under a minute)

Its parts: the shapes and their models (``scale_shapes``), the recipes (``scale_recipes``), one row's process
(``scale_process``), the queue of rows (``scale_queue``, admitted by ``scale_jobs``), the tables (``scale_report``).
Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file
from benchmarks.core.outputs import RESULTS, check_file_option, dated_base, write_text
from benchmarks.core.processes import load_average, log, machine_info
from benchmarks.core.recipes import causal_lm_recipes
from benchmarks.scale_jobs import MEMORY_FRACTION
from benchmarks.scale_process import run_one
from benchmarks.scale_queue import Queued, RowQueue, admit_rows, disk_free
from benchmarks.scale_recipes import (
    OFFLOAD_RECIPES,
    QUICK_RECIPES,
    RATIO,
    RECIPES,
    estimated_cost,
    split_variant,
    variant_raw,
)
from benchmarks.scale_report import STATEMENT, exponents, markdown, write_result
from benchmarks.scale_shapes import (
    BASELINE,
    CPU_REAL,
    GPU_REAL,
    OFFLOAD_MEMORY,
    OFFLOAD_SHAPE,
    QUICK_DEPTHS,
    QUICK_WIDTHS,
    REAL,
    Shape,
    build_device,
    dtype_bytes,
    half_the_layers,
    model_folder,
    resolve_dtype,
    sweep_shapes,
    synthetic_shape,
    width_shape,
)
from slimkit.primitives.errors import SlimkitError


def offload_memory(text: str) -> str:
    """``--offload-memory``: a size such as 1.5GiB, or ``none``."""
    return text if text.lower() == "none" else arg.size(text)


def build_parser() -> OneLineParser:
    from slimkit.primitives.datasets.data_paths import cache_root

    parser = OneLineParser("benchmarks.scale", __doc__)
    parser.add_argument(
        "--configs",
        type=arg.names,
        help=f"comma-separated real shapes (default CPU: {','.join(CPU_REAL)}; "
        f"CUDA adds llama-3.2-3b,llama-3.1-8b); known: {','.join(REAL)}; or wW-LL, a tiny llama (e.g. w64-L4)",
    )
    parser.add_argument(
        "--recipes",
        type=arg.names,
        help=f"comma-separated recipes (default {','.join(RECIPES)}); 'all': every bundled causal-LM recipe (with "
        "the other entries after them); NAME@KEY=VALUE[@KEY=VALUE...]: a bundled recipe with --set overrides (e.g. "
        "sp3-llm@stages.1.args.learning_rate=0), a row of its own",
    )
    parser.add_argument("--device", type=arg.device, default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    parser.add_argument(
        "--dtype",
        type=arg.dtype_name,
        default="auto",
        help="float32, bfloat16, float16 or auto (CPU float32, CUDA bf16)",
    )
    parser.add_argument("--threads", type=arg.integer(1), default=None, help="OMP/MKL threads of each run")
    parser.add_argument("--samples", type=arg.integer(1), default=8, help="calibration samples (default 8)")
    parser.add_argument("--seq-len", type=arg.integer(8), default=128, help="calibration sequence length (default 128)")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the depth and width sweeps")
    parser.add_argument(
        "--offload-shape", type=arg.one_of("shape", lambda: REAL), help=f"the offload rows' (default {OFFLOAD_SHAPE})"
    )
    parser.add_argument(
        "--offload-memory",
        type=offload_memory,
        help=f"their --max-memory (default {OFFLOAD_MEMORY}); 'none' skips them",
    )
    parser.add_argument("--skip", type=arg.names, help="comma-separated shape/recipe rows not to run")
    parser.add_argument(
        "--budget-s", type=arg.positive, help="start no run after this many seconds; runs go cheapest first"
    )
    parser.add_argument(
        "--jobs", type=arg.integer(1), default=1, help="rows run at the same time, admitted by expected peak memory"
    )
    parser.add_argument(
        "--memory-fraction",
        type=arg.share,
        default=MEMORY_FRACTION,
        help=f"with --jobs: the running rows' expected peaks sum to at most this share of the device's memory "
        f"(default {MEMORY_FRACTION})",
    )
    parser.add_argument(
        "--known-peaks",
        type=arg.input_file,
        nargs="+",
        action="extend",
        default=[],
        help="with --jobs: earlier results .json files whose measured peak GPU memory a row expects when above its "
        "memory plan",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (the smoke test)")
    parser.add_argument("--no-baseline", action="store_true", help="no baseline row (peak RSS above it is not shown)")
    parser.add_argument(
        "--tokenizer", type=arg.input_folder, help="tokenizer folder saved with the models (default smollm2-135m's)"
    )
    parser.add_output_folder("--models-dir", "the saved scale models", default=cache_root() / "scale-models")
    parser.add_output_folder(
        "--out", "the results", default=RESULTS, help="results folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the ok rows of today's results file of this name; run the rest"
    )
    parser.add_argument(
        "--resume-from",
        type=arg.input_file,
        help="as --resume, from this results .json (e.g. an earlier day's); the results go under today's name",
    )
    parser.add_argument("--note", action="append", default=[], help="a line for the results' 'Left out' list")
    parser.add_argument("--render", type=arg.input_file, help="only write the .md of this results .json")
    parser.add_argument("--name", type=arg.file_name, help="results are OUT/<date>-<name>.*; default 'scale'")
    return parser


def plan(args: argparse.Namespace) -> tuple[list[tuple[Shape, list[str]]], list[str], tuple[Shape, str] | None]:
    """The shapes (each with its sweeps), the recipes and the offload row's shape and budget, every option checked."""
    recipes = args.recipes or list(QUICK_RECIPES if args.quick else RECIPES)
    if "all" in recipes:  # every causal-LM recipe, then the other entries (variants) not already among them
        recipes = list(dict.fromkeys([*causal_lm_recipes(), *(r for r in recipes if r != "all")]))
    for recipe in recipes:
        try:
            arg.recipe(split_variant(recipe)[0])
            variant_raw(recipe)
        except argparse.ArgumentTypeError as error:
            raise BenchError(f"--recipes: {error}") from None
        except SlimkitError as error:
            raise BenchError(f"--recipes: {recipe}: {error}") from None
    for path in args.known_peaks:
        read_json_file(path, "--known-peaks")
    if args.resume_from is not None:
        read_json_file(args.resume_from, "--resume-from")
    configs = args.configs
    if configs is None:
        configs = [] if args.quick else list(GPU_REAL if args.device.startswith("cuda") else CPU_REAL)
    bad = [c for c in configs if c not in REAL and synthetic_shape(c) is None]
    if bad:
        raise BenchError(
            f"--configs: unknown shape(s) {', '.join(bad)}; known: {', '.join(REAL)}, or wW-LL (hidden W a multiple "
            "of 64, L layers, e.g. w64-L4)"
        )
    shapes: list[tuple[Shape, list[str]]] = []
    for config in configs:
        shape = REAL.get(config) or synthetic_shape(config)
        assert shape is not None
        shapes.append((shape, ["real"]))
    if not args.no_sweeps:
        shapes += sweep_shapes(args.quick)
    offload = None
    if (args.offload_memory or "").lower() != "none":
        if args.offload_shape:
            shape = REAL[args.offload_shape]
        else:
            shape = width_shape(QUICK_WIDTHS[-1], QUICK_DEPTHS[0], kind="width") if args.quick else REAL[OFFLOAD_SHAPE]
        dtype = resolve_dtype(args.device, args.dtype)
        memory = args.offload_memory or (half_the_layers(shape, dtype) if args.quick else OFFLOAD_MEMORY)
        offload = (shape, memory)
    return shapes, recipes, offload


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every row measured, the results rewritten after each; the baseline first, kept rows of ``--resume`` reused."""
    import torch

    from slimkit.primitives.device.placement import parse_size
    from slimkit.primitives.io import versions

    shapes, recipes, offload = plan(args)
    dtype = resolve_dtype(args.device, args.dtype)
    skip = set(args.skip or [])
    name = args.name or ("scale-quick" if args.quick else "scale")
    args.out.mkdir(parents=True, exist_ok=True)
    base = dated_base(args.out, name)
    start = time.perf_counter()
    result: dict[str, Any] = {
        "name": name,
        "date": dt.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.scale", *argv]),
        "statement": STATEMENT,
        "machine": machine_info(),
        "versions": versions(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "build_device": build_device(args.device),
        "settings": {
            "device": args.device,
            "dtype": dtype,
            "samples": args.samples,
            "seq_len": args.seq_len,
            "ratio": RATIO,
            "recipes": recipes,
            "shapes": [asdict(s) | {"sweeps": sweeps} for s, sweeps in shapes],
            "offload": None if offload is None else {"shape": offload[0].name, "max_memory": offload[1]},
            "quick": args.quick,
            "budget_s": args.budget_s,
        },
        "rows": [],
        "exponents": [],
        "cuts": [*args.note, *(f"skipped by --skip: {r}" for r in sorted(skip))],
        "build_s": 0.0,
    }
    args.models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slimkit-scale-") as scratch_name:
        scratch = Path(scratch_name)

        def folder_of(shape: Shape) -> Path:
            folder, seconds = model_folder(shape, dtype, args.models_dir, build_device(args.device), args.tokenizer)
            if seconds is not None:
                result["build_s"] += seconds
                result.setdefault("built", []).append({"shape": shape.name, "seconds": seconds})
                log(f"  built {shape.name} ({dtype}) on {build_device(args.device)} in {seconds:.0f} s -> {folder}")
            return folder

        def record(row: dict[str, Any]) -> None:
            baseline = (result.get("baseline") or {}).get("peak_rss_mb")
            if row.get("peak_rss_mb") is not None and baseline is not None:
                row["peak_rss_above_baseline_mb"] = max(row["peak_rss_mb"] - baseline, 0.0)
            result["rows"].append(row)
            result["wall_s"] = time.perf_counter() - start
            result["exponents"] = exponents(result["rows"], recipes)
            write_result(result, base)
            if row["status"] == "ok":
                log(
                    f"  {row['id']}: compress {row['compress_s']:.1f} s, load {row['load_s']:.1f} s, "
                    f"peak RSS {row['peak_rss_mb']:.0f} MB, achieved {row['achieved']:.2%}"
                )
            else:
                log(f"  {row['id']}: {row['status']}: {row.get('reason')}")

        source = args.resume_from or (base.with_suffix(".json") if args.resume else None)
        previous = read_json_file(source, "--resume-from") if source is not None and source.is_file() else {}
        kept = {r["id"]: r for r in previous.get("rows", []) if r.get("status") == "ok"}
        if kept:
            log(f"--resume: keeping {len(kept)} rows of {source}")
            result["resumed_from"] = str(source)
            result["rows"] += list(kept.values())
            result["build_s"] += previous.get("build_s") or 0.0
            result["resumed_wall_s"] = (previous.get("resumed_wall_s") or 0.0) + (previous.get("wall_s") or 0.0)
            result["cuts"] = [*previous.get("cuts", []), *result["cuts"]]
            result["machine"]["load_average_start"] = (previous.get("machine") or {}).get("load_average_start")
        # the baseline: a run of a tiny model (the process itself); in --quick the smallest sweep shape's
        # wanda-channels run, used again as that sweep row (one process fewer in the smoke test)
        base_shape = width_shape(QUICK_WIDTHS[0], QUICK_DEPTHS[0], kind="depth") if args.quick else BASELINE
        if args.no_baseline:
            baseline: dict[str, Any] = {"status": "not run"}
        elif (previous.get("baseline") or {}).get("status") == "ok":
            baseline = previous["baseline"]
        else:
            log(f"baseline ({base_shape.name}, wanda-channels)")
            baseline = run_one(base_shape, ["baseline"], folder_of(base_shape), "wanda-channels", args, dtype, scratch)
        result["baseline"] = baseline
        jobs: list[tuple[Shape, list[str], str, str | None]] = [(s, sw, r, None) for s, sw in shapes for r in recipes]
        if offload is not None:
            big, budget = offload
            if big.params()["total"] * dtype_bytes(dtype) <= parse_size(budget):
                result["cuts"].append(f"offload rows: {big.name}'s weights fit in {budget}; nothing to offload")
            else:
                jobs += [(big, ["offload"], r, budget) for r in OFFLOAD_RECIPES if r in recipes]
        if not args.quick:  # offload rows first (the budget claim), then cheapest first: a --budget-s cut drops
            # the most expensive runs
            jobs.sort(key=lambda job: (job[3] is None, estimated_cost(job[0], job[2], job[3] is not None)))
        log(f"{len(jobs)} runs on {args.device} ({dtype}); results {base}.*")
        if args.jobs > 1:
            log(f"--jobs {args.jobs}: run folders in {scratch} ({disk_free(scratch) / 2**30:.1f} GiB free)")
        queue: list[Queued] = []
        for index, (shape, sweeps, recipe, memory) in enumerate(jobs, 1):
            row_id = f"{shape.name}/{recipe}"
            if row_id in skip or row_id + ("@offload" if memory else "") in kept:
                continue
            queue.append(Queued(shape, sweeps, recipe, memory, f"[{index}/{len(jobs)}] {row_id}"))
        if args.jobs > 1:
            capacity, device_total = admit_rows(queue, args, dtype, result)
        else:  # one row at a time: nothing is ever beside a row, so no demand is needed
            capacity = device_total = 0.0
        rows = RowQueue(args, dtype, scratch, start, folder_of, record, (base_shape, baseline))
        rows.run(queue, capacity, device_total)
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_end"] = load_average()
    result["exponents"] = exponents(result["rows"], recipes)
    write_result(result, base)
    log(f"wrote {base}.json, {base}.md in {result['wall_s']:.0f} s")
    return result


def interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # a SIGTERM (``timeout``) ends as Ctrl-C does: running rows stopped, results kept


def main_body(argv: list[str]) -> None:
    import signal

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        args = build_parser().parse(argv)
        if args.render is not None:  # the markdown again from a results file (e.g. after a change to the tables)
            check_file_option("--render", args.render.with_suffix(".md"))
            result = read_json_file(args.render, "--render")
            write_text(args.render.with_suffix(".md"), markdown(result), "--render")
            return
        run(args, argv)
    finally:  # the handler is the benchmark's only while it runs (main() may be called in a longer process)
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
