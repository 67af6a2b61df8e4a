"""Executing a recipe: load, calibrate, run stages, save, evaluate, report.

Everything is written to a hidden sibling of the output folder and renamed into place at the end,
so an interrupted run leaves no ``DIR/model/`` that loads (and an existing ``DIR`` is only
replaced, with ``force``, once the new run has finished).
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import count_macs, params_by_part
from slimkit.primitives.io import versions
from slimkit.primitives.paths import staging_dir
from slimkit.primitives.sources import load_source
from slimkit.recipes.context import Context
from slimkit.recipes.layerwise import run_layerwise
from slimkit.recipes.progress import Tracker
from slimkit.recipes.registry import stage_def
from slimkit.recipes.schema import CalibrationConfig, EvalConfig, Recipe, SequentialSpec, is_glue_dataset
from slimkit.recipes.stages import TARGET_PART

MACS_SEQ_LEN = 128


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise SlimkitError(f"output {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise SlimkitError(f"output directory {out} exists and is not empty (use --force to replace it)")


class Timings:
    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[label] = self.stages.get(label, 0.0) + time.perf_counter() - start

    def as_dict(self) -> dict[str, Any]:
        return {"total": time.perf_counter() - self.start, "stages": self.stages}


def _calibrate(ctx: Context, recipe: Recipe) -> dict[str, Any] | None:
    config = recipe.calibration_config()
    if config is None:
        return None
    examples = config.examples if is_glue_dataset(config.dataset) else None
    spec = CalibrationSpec(config.dataset, config.samples, config.seq_len, recipe.seed, examples=examples)
    ctx.calibration = calibration_batches(ctx.tokenizer, spec)
    return spec.describe()


def _run_stages(ctx: Context, recipe: Recipe, timings: Timings, tracker: Tracker) -> None:
    for index, item in enumerate(recipe.stages):
        if isinstance(item, SequentialSpec):
            label = f"{index}:sequential[{','.join(s.stage for s in item.sequential)}]"
            children, propagate = item.sequential, "compressed"
        else:
            label = f"{index}:{item.stage}"
            definition = stage_def(item.stage)
            if definition.scope == "model":
                with timings.stage(label):
                    definition.fn(ctx, item.parsed_args())
                continue
            children, propagate = [item], "dense"
        with timings.stage(label), tracker.task(label, ctx.view.num_layers) as advance:
            run_layerwise(ctx, children, propagate, on_layer=lambda _i: advance(1))


def preflight_data(config: EvalConfig, calibration: CalibrationConfig | None) -> None:
    """Read every data file the run will need now, so a missing one fails before any compute."""
    from slimkit.primitives import gluedata, textdata

    if calibration is not None:
        task = gluedata.calibration_task(calibration.dataset)
        if task is not None:
            gluedata.read_split(task, "train")
        else:
            textdata.documents(calibration.dataset)
    if config.perplexity is not None:
        for dataset in config.perplexity.datasets:
            textdata.documents(dataset)
    if config.zeroshot is not None:
        from slimkit.primitives.evaluate.zeroshot import prepare_task_data

        for task in config.zeroshot.tasks:
            prepare_task_data(task)
    if config.glue is not None and config.glue.task is not None:
        gluedata.read_split(config.glue.task, "dev")


def evaluate(model, tokenizer, config: EvalConfig, tracker: Tracker, timings: Timings) -> tuple[dict, dict]:
    """Run the configured evaluations; returns flat ``metrics`` and per-evaluation ``details``."""
    from slimkit.primitives.evaluate.perplexity import perplexity

    metrics: dict[str, float] = {}
    details: dict[str, Any] = {}
    ppl = config.perplexity
    if ppl is not None:
        details["perplexity"] = []
        for dataset in ppl.datasets:
            with timings.stage(f"eval:{dataset}"), tracker.task(f"perplexity {dataset}", None) as advance:
                result = perplexity(model, tokenizer, dataset, ppl.seq_len, ppl.max_tokens, ppl.batch_size, advance)
            metrics[f"{dataset}_ppl"] = result.perplexity
            details["perplexity"].append(result.as_dict())
    zs = config.zeroshot
    if zs is not None and zs.tasks:
        from slimkit.primitives.evaluate.zeroshot import evaluate_zeroshot

        with timings.stage("eval:zeroshot"):
            results = evaluate_zeroshot(model, tokenizer, zs.tasks, limit=zs.limit, batch_size=zs.batch_size)
        details["zeroshot"] = {"limit": zs.limit, "results": results}
        for task, values in results.items():
            for key in ("acc", "acc_norm"):
                if key in values:
                    metrics[f"{task}_{key}"] = values[key]
        metrics["zeroshot_mean_acc"] = sum(v["acc"] for v in results.values()) / len(results)
    if config.glue is not None:
        metrics.update(_evaluate_glue(model, tokenizer, config, tracker, timings, details))
    if config.speed:
        from slimkit.primitives.evaluate.speed import throughput

        with timings.stage("eval:speed"):
            details["speed"] = throughput(model, len(tokenizer)).as_dict()
    return metrics, details


def _evaluate_glue(model, tokenizer, config: EvalConfig, tracker: Tracker, timings: Timings, details: dict) -> dict:
    """GLUE dev metrics as ``glue_<task>_<metric>``; the task is the config's, else the one the model records."""
    from slimkit.primitives.evaluate.glue import evaluate_glue
    from slimkit.primitives.gluedata import glue_task

    task = config.glue.task or getattr(getattr(model, "config", None), "finetuning_task", None)
    if task is None:
        raise SlimkitError("eval.glue: no task given and the model records none; name one (e.g. --glue sst2)")
    settings = config.glue
    with timings.stage(f"eval:glue_{task}"), tracker.task(f"glue {task}", None) as advance:
        result = evaluate_glue(
            model, tokenizer, task, settings.limit, settings.batch_size, settings.max_length, advance
        )
    details["glue"] = result
    return {f"glue_{task}_{key}": result[key] for key in glue_task(task).metrics}


def run_recipe(
    recipe: Recipe,
    raw: dict[str, Any],
    out: Path,
    force: bool = False,
    run_eval: bool = True,
    tracker: Tracker | None = None,
) -> dict[str, Any]:
    """Run ``recipe`` and write ``out/model``, ``out/report.json``, ``out/report.md``; returns the report."""
    tracker = tracker or Tracker()
    out = Path(out)
    check_output_dir(out, force)
    preflight_data(
        recipe.eval if run_eval else EvalConfig(perplexity=None),
        recipe.calibration_config(),
    )
    timings = Timings()
    torch.manual_seed(recipe.seed)

    with timings.stage("load"):
        model, tokenizer, info = load_source(recipe.model)
        if recipe.task is not None:
            from slimkit.primitives.finetune.glue import task_model

            model = task_model(model, recipe.task, seed=recipe.seed)
    if tokenizer is None:
        raise SlimkitError(f"model source '{recipe.model}' has no tokenizer")
    ctx = Context(
        recipe=recipe,
        model=model,
        tokenizer=tokenizer,
        source={"name": info.name, "path": info.path},
        generator=torch.Generator().manual_seed(recipe.seed),
        tracker=tracker,
    )
    ctx.params_before = params_by_part(model)
    widths_before = ctx.view.layer_widths()
    macs_before = count_macs(model, MACS_SEQ_LEN)

    with timings.stage("calibration"):
        calibration = _calibrate(ctx, recipe)
    _run_stages(ctx, recipe, timings, tracker)

    params_after = params_by_part(ctx.model)
    part = TARGET_PART[recipe.target.of]
    if calibration and recipe.eval.perplexity and calibration["dataset"] in recipe.eval.perplexity.datasets:
        ctx.notes.append(
            f"calibration and perplexity evaluation both use {calibration['dataset']}: "
            "the perplexity on it is optimistic"
        )

    staging = staging_dir(out)
    try:
        manifest = {
            "recipe_name": recipe.name,
            "recipe": raw,
            "seed": recipe.seed,
            "source": ctx.source,
            "calibration": calibration,
            "target": recipe.target.model_dump(),
            **ctx.manifest,
        }
        with timings.stage("save"):
            slimkit.save(ctx.model, tokenizer, staging / "model", manifest=manifest)
            (staging / "model" / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        metrics, details = evaluate(ctx.model, tokenizer, recipe.eval, tracker, timings) if run_eval else ({}, {})
        report = {
            "recipe": recipe.name,
            "model": recipe.model,
            "seed": recipe.seed,
            "target": {
                "ratio": recipe.target.ratio,
                "of": recipe.target.of,
                "achieved": 1.0 - params_after[part] / ctx.params_before[part],
            },
            "params": {
                "before": ctx.params_before["total"],
                "after": params_after["total"],
                "removed_ratio": 1.0 - params_after["total"] / ctx.params_before["total"],
                "by_part_before": ctx.params_before,
                "by_part_after": params_after,
            },
            "macs": {"before": macs_before, "after": count_macs(ctx.model, MACS_SEQ_LEN), "seq_len": MACS_SEQ_LEN},
            "timings_s": timings.as_dict(),
            "peak_rss_mb": peak_rss_mb(),
            "metrics": metrics,
            "evaluation": details,
            "calibration": calibration,
            "stages": ctx.stage_report,
            "layers": {"before": widths_before, "after": ModelView(ctx.model).layer_widths()},
            "notes": ctx.notes,
            "versions": versions(),
        }
        from slimkit.recipes.report import write_report

        for name, writer in ctx.artifacts.items():
            writer(staging / name)

        write_report(report, staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report
