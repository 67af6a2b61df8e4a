"""Run the benchmark grid: every recipe x target ratio x recovery setting, side by side, in one command.

    python -m benchmarks.run                       # the full grid of benchmarks/grid.yaml (hours)
    python -m benchmarks.run --quick               # the smoke-sized grid (minutes)

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.grid import (
    DENSE,
    GRID_FILE,
    BenchError,
    Job,
    Settings,
    expand,
    load_grid,
    parse_ratios,
    resolve_settings,
    select_entries,
)
from benchmarks.inputs import OneLineParser, check_folder_option, read_json_file, read_yaml_file
from benchmarks.seeds import add_norm_mean, seed_groups
from slimkit.primitives.files.removal import discard

RESULTS = Path(__file__).resolve().parent / "results"
ROW_FILE = "bench-row.json"
"""Where a kept run folder records its measured row (reused by ``--resume``)."""
RECOVERY_STAGES = ("lora", "distill")  # top-level stages a row "without recovery" runs with steps=0
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUIET_ENV = {"TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # lm-eval's progress bars, per row


_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def via_launcher(command: list[str]) -> list[str]:
    """``command`` started by a small Python launcher. Linux carries the forking process's peak RSS into
    an exec'd child's ``ru_maxrss`` (what a run's report states as its peak); this process holds the
    dense model, the launcher holds almost nothing, so the number becomes the run's own."""
    return [sys.executable, "-c", _LAUNCHER, *command]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_Parser = OneLineParser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke-sized grid and budgets of grid.yaml")
    parser.add_argument("--only", help="comma-separated recipes to run (dense always runs)")
    parser.add_argument("--ratios", help="comma-separated target ratios, 0.2 or 20 (narrows each entry's ratios)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results (default benchmarks/results)")
    parser.add_argument("--name", help="results are OUT/<date>-<name>.*; default 'grid' or 'quick'")
    parser.add_argument("--ppl-tokens", type=int, help="perplexity token budget per dataset")
    parser.add_argument("--zeroshot-limit", type=int, help="examples per zero-shot task (0 skips zero-shot)")
    parser.add_argument("--zeroshot-tasks", help="comma-separated zero-shot tasks ('' skips zero-shot)")
    parser.add_argument("--speed-rounds", type=int, help="interleaved speed rounds per row")
    parser.add_argument("--device", help="compress and evaluate every row on: auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", help="the weights' dtype: auto (default), float32, bfloat16, float16")
    parser.add_argument(
        "--threads", type=int, help="torch threads here and in the compression processes (default: torch's)"
    )
    parser.add_argument("--grid", type=Path, default=GRID_FILE, help="grid file (default benchmarks/grid.yaml)")
    parser.add_argument("--keep", type=Path, help="keep every run folder under this folder")
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


# ------------------------------------------------------------------------------------------ helpers


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def machine_info() -> dict[str, Any]:
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
        "gpu": _gpu_info() if torch.cuda.is_available() else None,
        "cpu": cpu or "unknown CPU",
        "cores": os.cpu_count(),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def placement_of(model) -> dict[str, Any]:
    """Where ``model`` is and in which dtype, as a run report's ``placement`` states it (``device``, ``dtype`` and,
    on CUDA, ``gpu``, ``gpu_memory_gib``, ``cuda``)."""
    from slimkit.primitives.device.placement import Placement

    parameter = next(model.parameters())
    return Placement(parameter.device, parameter.dtype).describe()


def _gpu_info() -> dict[str, Any]:
    """The current CUDA device as a run report describes it: ``gpu`` (name), ``gpu_memory_gib``, ``cuda``."""
    import torch

    from slimkit.primitives.device.placement import Placement

    described = Placement(torch.device("cuda", torch.cuda.current_device()), torch.float32).describe()
    return {key: described[key] for key in ("gpu", "gpu_memory_gib", "cuda")}


def eval_config(settings: Settings):
    from slimkit.primitives.evaluate.eval_settings import EvalConfig

    perplexity = None
    if settings.ppl_datasets:
        perplexity = {
            "datasets": settings.ppl_datasets,
            "seq_len": settings.ppl_window,
            "max_tokens": settings.ppl_tokens,
        }
    zeroshot = {"tasks": settings.zeroshot_tasks, "limit": settings.zeroshot_limit} if settings.zeroshot_on else None
    return EvalConfig.model_validate({"perplexity": perplexity, "zeroshot": zeroshot, "speed": False})


_RESIDUAL_NAMES = ("residual", "basis_change", "basischange")


def read_report(folder: Path):
    """The run report ``folder/report.json`` (:class:`slimkit.engine.report.RunReport`), or None when it is missing
    or not one (a report of an older slimkit that lacks a field this one needs); read with bounds
    (:func:`benchmarks.inputs.read_json_file`: a FIFO, a huge or deeply nested file is one line)."""
    from pydantic import ValidationError

    from slimkit.engine.report import RunReport

    path = folder / "report.json"
    if not os.path.lexists(path):
        return None
    data = read_json_file(path, "a kept run report")
    try:
        return RunReport.model_validate(data)
    except ValidationError:
        return None


def residual_params_in_model(model) -> int:
    """Parameters of modules or tensors named or typed as residual / basis-change matrices (SP3's
    ``BasisChange`` at ``<host>.basis_change``, or ``residual`` in a parameter's path or class name)."""
    total = 0
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        typed = any(n in type(module).__name__.lower() for n in _RESIDUAL_NAMES)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            if typed or any(n in f"{module_name}.{name}".lower() for n in _RESIDUAL_NAMES):
                seen.add(id(param))
                total += param.numel()
    return total


def lowrank_params(model) -> int:
    from slimkit.primitives.lowrank import LowRankLinear

    return sum(p.numel() for m in model.modules() if isinstance(m, LowRankLinear) for p in m.parameters())


def layer_params(model) -> list[int]:
    from slimkit.primitives.arch import ModelView

    return [layer.num_params() for layer in ModelView(model).layers]


def layer_widths(model, saved: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per-layer widths: the saved ones (manifest ``layer_widths``) or the model's, each with the hidden
    width the layer works in (its q projection's input width; SP3 changes it per group)."""
    from slimkit.primitives.arch import ModelView

    view = ModelView(model)
    widths = [dict(w) for w in (saved or view.layer_widths())]
    try:
        hidden = [int(layer.linear("q").in_features) for layer in view.layers]
    except (AttributeError, KeyError, ValueError):
        return widths
    if len(hidden) == len(widths):
        for width, size in zip(widths, hidden, strict=True):
            width.setdefault("hidden_size", size)
    return widths


def finite_numbers(node: Any) -> bool:
    return all(math.isfinite(v) for v in _numbers(node))


def _numbers(node: Any):
    if isinstance(node, bool):
        return
    if isinstance(node, int | float):
        yield float(node)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _numbers(value)


def _normalised(stored: Any) -> Any:
    """Stored settings with the defaults of fields added since they were written (a row measured before
    ``device`` existed was measured under ``device: auto``), so such rows stay reusable."""
    from pydantic import ValidationError

    from benchmarks.grid import Settings

    try:
        return json.loads(json.dumps(Settings.model_validate(stored).model_dump()))
    except ValidationError:  # not settings this code can read: never equal
        return stored


def row_slug(row_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", row_id.replace("@", "-r"))


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln.startswith(("error:", "Error", "RuntimeError", "ValueError"))]
    return (errors or lines or ["no output"])[-1][:300]


# ---------------------------------------------------------------------------------------- the rows


class Bench:
    def __init__(
        self,
        settings: Settings,
        runs: Path,
        keep: bool,
        resume: bool,
        threads: int | None = None,
        reuse_only: bool = False,
    ) -> None:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        self.thread_env = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.settings = settings
        self.runs = runs
        self.keep = keep
        self.resume = resume
        self.reuse_only = reuse_only
        """Only collect rows measured earlier (``--reuse-only``); never compress or measure a row."""
        self.config = eval_config(settings)
        self._dense: tuple[Any, Any, list[int]] | None = None
        self.dense_speed: list[tuple[float, float]] = []

    def _loaded(self) -> tuple[Any, Any, list[int]]:
        """The dense model, its tokenizer and its layers' parameter counts, loaded on first use (assembling
        stored rows with ``--reuse-only`` needs none of them, so rows measured on a GPU can be assembled
        on a machine without one)."""
        if self._dense is None:
            model, tokenizer = self.load(self.settings.model)
            self._dense = (model, tokenizer, layer_params(model))
        return self._dense

    def load(self, source: str) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of ``source`` on the settings' device and dtype."""
        import slimkit

        model, tokenizer, _info = slimkit.load_source(source, device=self.settings.device, dtype=self.settings.dtype)
        return model, tokenizer

    @property
    def dense(self):
        return self._loaded()[0]

    @property
    def tokenizer(self):
        return self._loaded()[1]

    @property
    def dense_layer_params(self) -> list[int]:
        return self._loaded()[2]

    def evaluate(self, model, config=None) -> tuple[dict[str, float], dict[str, Any], float]:
        """Perplexity and zero-shot of ``model`` under ``config`` (default: the settings')."""
        from slimkit.primitives.evaluate.run import evaluate_model

        start = time.perf_counter()
        evaluation = evaluate_model(model, self.tokenizer, config or self.config)
        metrics, details = evaluation.metrics, evaluation.details
        add_norm_mean(metrics)
        details["seconds"] = dict(evaluation.seconds)  # per evaluation (eval:wikitext2, eval:zeroshot, ...)
        return metrics, details, time.perf_counter() - start

    def speed(self, row_id: str, model) -> dict[str, Any]:
        from benchmarks.speed import measure

        s = self.settings.speed
        vocab = len(self.tokenizer)
        dense, row = measure(
            [(DENSE, self.dense, vocab), (row_id, model, vocab)], s.rounds, s.prompt_len, s.new_tokens, s.batch
        )
        self.dense_speed.append((dense["prefill_tokens_per_s"], dense["decode_tokens_per_s"]))
        return {
            "prefill_tokens_per_s": row["prefill_tokens_per_s"],
            "decode_tokens_per_s": row["decode_tokens_per_s"],
            "dense_prefill_tokens_per_s": dense["prefill_tokens_per_s"],
            "dense_decode_tokens_per_s": dense["decode_tokens_per_s"],
            "prefill_ratio": row["prefill_ratio"],
            "decode_ratio": row["decode_ratio"],
        }

    def dense_row(self) -> dict[str, Any]:
        from slimkit.engine.report import MACS_SEQ_LEN
        from slimkit.primitives.evaluate.counting import count_macs, params_by_part

        metrics, details, seconds = self.evaluate(self.dense)
        total = params_by_part(self.dense)["total"]
        macs = count_macs(self.dense, MACS_SEQ_LEN)
        return {
            "id": DENSE,
            "recipe": DENSE,
            "placement": placement_of(self.dense),
            "ratio": None,
            "recovery": False,
            "status": "ok",
            "params": {"before": total, "after": total, "removed_ratio": 0.0},
            "macs": {"before": macs, "after": macs, "seq_len": MACS_SEQ_LEN},
            "metrics": metrics,
            "evaluation": details,
            "eval_s": seconds,
            "layers": {
                "widths": layer_widths(self.dense),
                "params": self.dense_layer_params,
                "dense_params": self.dense_layer_params,
            },
        }

    def read_row(self, path: Path, settings: Settings | None = None) -> dict[str, Any] | None:
        """The row stored at ``path`` if it was measured under ``settings`` (default these; marked as
        reused), else None."""
        if not os.path.lexists(path):
            return None
        stored = read_json_file(path, "a kept row")
        if not isinstance(stored.get("row"), dict):
            raise BenchError(f"a kept row: {path} holds no 'row' object; delete it to measure the row again")
        if _normalised(stored.get("settings")) != json.loads(json.dumps((settings or self.settings).model_dump())):
            return None
        return {**stored["row"], "evaluation_reused": True}

    def write_row(self, path: Path, row: dict[str, Any], settings: Settings | None = None) -> None:
        """Store ``row`` with ``settings`` (default these), for a later ``--resume``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"settings": (settings or self.settings).model_dump(), "row": row}
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")

    def kept_dense_row(self) -> dict[str, Any]:
        """The dense row; with ``--keep``, stored in DIR/dense (without its speed) and, with ``--resume``,
        reused when it was measured under the same settings."""
        path = self.runs / DENSE / ROW_FILE
        stored = self.read_row(path) if self.resume else None
        if stored is not None:
            log(f"  reusing the dense row measured in {path.parent}")
            return stored
        row = self.dense_row()
        if self.keep:
            self.write_row(path, row)
        return row

    def finish_dense(self, row: dict[str, Any]) -> None:
        """The dense row's speed: the medians of its measurements in every pair (or its own if none ran)."""
        import statistics

        from benchmarks.speed import measure

        if not self.dense_speed:
            s = self.settings.speed
            (only,) = measure([(DENSE, self.dense, len(self.tokenizer))], s.rounds, s.prompt_len, s.new_tokens, s.batch)
            self.dense_speed.append((only["prefill_tokens_per_s"], only["decode_tokens_per_s"]))
        prefill = statistics.median(x[0] for x in self.dense_speed)
        decode = statistics.median(x[1] for x in self.dense_speed)
        row["speed"] = {
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode,
            "dense_prefill_tokens_per_s": prefill,
            "dense_decode_tokens_per_s": decode,
            "prefill_ratio": 1.0,
            "decode_ratio": 1.0,
        }

    def prepare(self, job: Job) -> tuple[dict[str, Any], list[str] | None, dict[str, Any] | None]:
        """The row's skeleton and the run's overrides, or a "not run"/"failed" row (overrides None)."""
        from slimkit.primitives.errors import SlimkitError
        from slimkit.recipes.loading import bundled_recipes, load_recipe

        row: dict[str, Any] = {
            "id": job.id,
            "recipe": job.name,
            **({"recipe_source": job.recipe} if job.label else {}),
            "ratio": job.ratio,
            "recovery": job.recovery,
            **({"seed": job.seed, "seed_of": job.group} if job.seed is not None else {}),
            "status": "ok",
        }
        if job.recipe not in bundled_recipes() and not Path(job.recipe).is_file():
            return {**row, "status": "not run", "reason": f"recipe '{job.recipe}' does not exist (yet)"}, None, None
        # Not strict: a row that misses its target (granularity, an explicit stage ratio) is still measured,
        # and flagged with the report's target.met.
        s = self.settings
        placement = [f"model.{k}={v}" for k, v in (("device", s.device), ("dtype", s.dtype)) if v != "auto"]
        overrides = [f"model={s.model}", *placement, f"target.ratio={job.ratio}", "target.strict=false", *job.overrides]
        try:
            recipe, _raw = load_recipe(job.recipe, overrides)
            lora = [i for i, s in enumerate(recipe.stages) if getattr(s, "stage", None) in RECOVERY_STAGES]
            if job.recovery and not lora:
                reason = "the recipe has no top-level lora stage (nor distill), so there is no recovery variant"
                return {**row, "status": "not run", "reason": reason}, None, None
            if not job.recovery:
                overrides += [f"stages.{i}.args.steps=0" for i in lora]
            recipe, raw = load_recipe(job.recipe, overrides)
        except SlimkitError as error:
            return {**row, "status": "failed", "reason": f"recipe does not load: {error}"}, None, None
        row.update(of=recipe.target.of, overrides=overrides, recovery_stages=lora)
        return row, overrides, raw

    def reusable(self, folder: Path, raw: dict[str, Any]) -> bool:
        """With ``--resume``: ``folder`` holds a finished run of exactly this recipe (after overrides)."""
        if not (self.resume and (folder / "report.json").is_file() and (folder / "model" / "recipe.yaml").is_file()):
            return False
        return read_yaml_file(folder / "model" / "recipe.yaml", "a kept recipe") == raw

    def stored_row(self, folder: Path, raw: dict[str, Any], settings: Settings | None = None) -> dict[str, Any] | None:
        """With ``--resume``: the row measured earlier on this run folder under the same settings, if any."""
        return self.read_row(folder / ROW_FILE, settings) if self.reusable(folder, raw) else None

    def compress(self, job: Job, overrides: list[str], raw: dict[str, Any]) -> tuple[Path, float | None, str | None]:
        """Run the recipe in its own process; ``(run folder, wall seconds or None if reused, error)``."""

        folder = self.runs / row_slug(job.id)
        if self.reusable(folder, raw):
            if read_report(folder) is not None:
                log(f"  reusing {folder}")
                return folder, None, None
            log(f"  compressing again: {folder / 'report.json'} is not a run report this code reads")
        # The old run's row goes with it: --force replaces only a folder holding nothing but a run's output.
        (folder / ROW_FILE).unlink(missing_ok=True)
        sets = [x for o in overrides for x in ("--set", o)]
        command = [sys.executable, "-m", "slimkit.cli.main", "recipe", "run", job.recipe, "--out", str(folder)]
        command += ["--no-eval", "--force", *sets]
        command = via_launcher(command)
        log_path = self.runs / f"{row_slug(job.id)}.log"
        start = time.perf_counter()
        with log_path.open("w") as handle:
            handle.write(shlex.join(command) + "\n")
            handle.flush()
            env = {**os.environ, **OFFLINE_ENV, **self.thread_env}
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            return folder, wall, f"slimkit recipe run exited with {done.returncode}: {last_line(log_path)}"
        return folder, wall, None

    def run_job(self, job: Job) -> dict[str, Any]:
        from slimkit.engine.report import MACS_SEQ_LEN
        from slimkit.primitives.evaluate.counting import count_macs
        from slimkit.primitives.io import read_manifest

        row, overrides, raw = self.prepare(job)
        if overrides is None:
            return row
        settings = self.settings.for_job(job)  # without zero-shot for a `zeroshot: false` entry
        if not job.zeroshot:
            row["zeroshot"] = "skipped (zeroshot: false in the grid)"
        stored = self.stored_row(self.runs / row_slug(job.id), raw, settings)
        if stored is not None:
            log(f"  reusing the row measured on {self.runs / row_slug(job.id)}")
            if "placement" not in stored:  # rows stored before rows recorded it: their run's report has it
                report = read_report(self.runs / row_slug(job.id))
                stored["placement"] = report.placement.model_dump() if report is not None else None
            speed = stored.get("speed") or {}
            if speed.get("dense_prefill_tokens_per_s") and speed.get("dense_decode_tokens_per_s"):
                # the dense model's measurements in that row's pair count towards the dense row's speed
                self.dense_speed.append((speed["dense_prefill_tokens_per_s"], speed["dense_decode_tokens_per_s"]))
            return stored
        if self.reuse_only:
            reason = f"no row measured under these settings in {self.runs} (--reuse-only)"
            return {**row, "status": "not run", "reason": reason}
        folder, wall, error = self.compress(job, overrides, raw)
        if error:
            return {**row, "status": "failed", "reason": error}
        report = read_report(folder)
        if report is None:
            return {**row, "status": "failed", "reason": f"{folder / 'report.json'} is not a slimkit run report"}
        manifest = read_manifest(folder / "model") or {}
        stored = report.as_json()
        timings = report.timings_s.stages
        row.update(
            {
                "achieved": report.target.achieved,
                "target_met": report.target.met,
                "params": {k: v for k, v in stored["params"].items() if k != "by_part_before"},
                "macs": stored["macs"],
                "cost": {
                    "compress_s": report.timings_s.compress_seconds(),
                    "stages_s": {k: v for k, v in timings.items() if not k.startswith("eval:")},
                    "process_wall_s": wall,
                    "reused": wall is None,
                    "peak_rss_mb": report.peak_rss_mb,
                    "calibration": report.calibration,
                    "extra_calibration_tokens": report.stage_sum("calibration_tokens"),
                    "recovery_tokens": report.stage_sum("training_tokens", RECOVERY_STAGES),
                },
                "stages": stored["stages"],
                "notes": report.notes,
                "placement": stored["placement"],
                "versions": report.versions,
                "run_folder": str(folder) if self.keep else None,
            }
        )
        model = None
        try:
            model, _tokenizer = self.load(str(folder / "model"))
            metrics, details, seconds = self.evaluate(model, eval_config(settings))
            # counted here, on the saved model, so a reused run folder is counted by this code too
            row["macs"] = {**(row["macs"] or {}), "after": count_macs(model, MACS_SEQ_LEN), "seq_len": MACS_SEQ_LEN}
            reported = report.stage_sum("params_added")
            row["structure"] = {
                "residual_params": reported if reported is not None else residual_params_in_model(model),
                "residual_source": "stage report" if reported is not None else "model",
                "lowrank_params": lowrank_params(model),
            }
            row["metrics"], row["evaluation"], row["eval_s"] = metrics, details, seconds
            row["layers"] = {
                "widths": layer_widths(model, manifest.get("layer_widths") or stored["layers"]["after"]),
                "params": layer_params(model),
                "dense_params": self.dense_layer_params,
            }
            row["speed"] = self.speed(job.id, model)
        except Exception as exc:  # a saved model that does not load or evaluate is a failed row, not a crash
            row.update(status="failed", reason=f"evaluation: {type(exc).__name__}: {exc}"[:300])
        del model
        gc.collect()
        if not self.keep:
            discard(folder / "model")
        elif row["status"] == "ok":  # --resume continues an interrupted grid without measuring this row again
            self.write_row(folder / ROW_FILE, row, settings)
        return row


# ------------------------------------------------------------------------------------------- output


def write_result(result: dict[str, Any], base: Path, plots: bool) -> list[Path]:
    from benchmarks.tables import markdown, plot_quality, plot_widths

    written: list[Path] = []
    if plots:
        quality = plot_quality(result["rows"], base.parent / f"{base.name}-quality.png")
        written = ([quality] if quality else []) + plot_widths(result["rows"], base)
    tmp = base.parent / f".{base.name}.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, base.with_suffix(".json"))
    base.with_suffix(".md").write_text(markdown(result, [str(p) for p in written]))
    return written


def plan(args: argparse.Namespace) -> tuple[Any, Settings, list[Job]]:
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
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only is not None and not only:
        raise BenchError("--only: no recipe given")
    ratios = parse_ratios(args.ratios) if args.ratios is not None else None
    jobs = expand(select_entries(entries, only), settings, ratios)
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be at least 1, got {args.threads}")
    if args.reuse_only and not args.resume:
        raise BenchError("--reuse-only needs --resume (and --keep DIR)")
    if args.resume and args.keep is None:
        raise BenchError("--resume needs --keep DIR (the folder whose runs it reuses)")
    check_folder_option("--out", args.out, "the results")
    if args.keep is not None:
        check_folder_option("--keep", args.keep, "the kept runs")
    return grid, settings, jobs


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from benchmarks.claims import evaluate_claims
    from slimkit.engine.report import peak_rss_mb
    from slimkit.primitives.evaluate.run import preflight_eval_data
    from slimkit.primitives.io import versions

    grid, settings, jobs = plan(args)
    name = args.name or ("quick" if args.quick else "grid")
    preflight_eval_data(eval_config(settings))
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{dt.date.today().isoformat()}-{name}"
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
        result["machine"]["torch_threads"] = torch_threads()
        dense = bench.kept_dense_row()
        add_norm_mean(dense.get("metrics") or {})  # a dense row stored before the mean existed
        result["rows"].append(dense)
        log(f"[dense] {_summary(dense)}")
        for index, job in enumerate(jobs, 1):
            log(f"[{index}/{len(jobs)}] {job.id} ...")
            job_start = time.perf_counter()
            row = bench.run_job(job)
            row["bench_s"] = time.perf_counter() - job_start
            add_norm_mean(row.get("metrics") or {})  # rows reused from before the mean existed
            result["rows"].append(row)
            log(f"[{index}/{len(jobs)}] {job.id}: {_summary(row)} ({row['bench_s']:.0f} s)")
            result["wall_s"] = time.perf_counter() - start
            result["seed_groups"] = seed_groups(result["rows"])
            result["claims"] = evaluate_claims(grid.claims, result["rows"])
            write_result(result, base, plots=False)
        bench.finish_dense(dense)
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["bench_peak_rss_mb"] = peak_rss_mb()  # this process: the dense model, one row's model, evaluation
    result["seed_groups"] = seed_groups(result["rows"])
    result["claims"] = evaluate_claims(grid.claims, result["rows"])
    plots = write_result(result, base, plots=True)
    log(f"wrote {base}.json, {base}.md" + "".join(f", {p.name}" for p in plots) + f" in {result['wall_s']:.0f} s")
    return result


def _summary(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason')}"
    metrics = ", ".join(
        f"{k} {v:.4g}" for k, v in row.get("metrics", {}).items() if k.endswith(("_ppl", "mean_acc", "mean_acc_norm"))
    )
    removed = row.get("params", {}).get("removed_ratio")
    return f"params removed {removed:.2%}, {metrics}" if removed is not None else metrics


def bench_main(argv: list[str] | None, body: Callable[[list[str]], int | None]) -> int:
    """A benchmark's ``main``: the offline, quiet environment first (before tqdm is imported: it reads it
    then), then ``body(argv)``; a :class:`BenchError` or :class:`SlimkitError` prints one ``error:`` line
    (exit 2), Ctrl-C keeps the results written so far (130)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for key, value in {**OFFLINE_ENV, **QUIET_ENV}.items():
        os.environ.setdefault(key, value)
    from slimkit.primitives.errors import SlimkitError

    try:
        return body(argv) or 0
    except (BenchError, SlimkitError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the results written so far are kept)", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
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
    return bench_main(argv, _main)


if __name__ == "__main__":
    sys.exit(main())
