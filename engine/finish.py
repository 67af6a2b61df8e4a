"""The run's last phase: the target checked, the weights checked finite, the model saved and exported, evaluated,
the typed report built and written, and the output folder published in one step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from slimkit.engine import output_safety
from slimkit.engine.context import Context
from slimkit.engine.dense_comparison import compare_with_dense
from slimkit.engine.dispatch import StageRun, StagesOutcome
from slimkit.engine.error_translation import output_write_errors
from slimkit.engine.progress import Timings
from slimkit.engine.report import (
    MACS_SEQ_LEN,
    DenseComparison,
    RunReport,
    StageReport,
    TargetOutcome,
    peak_rss_mb,
)
from slimkit.engine.run_result import Result, RunOptions
from slimkit.primitives.arch import ModelView
from slimkit.primitives.device.memory_model import MemoryPlan
from slimkit.primitives.device.offload import is_offloaded
from slimkit.primitives.device.placement import Placement, dtype_name, peak_memory_mb
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import count_macs, params_by_part
from slimkit.primitives.evaluate.run import Evaluation, evaluate_model
from slimkit.primitives.files.atomic import staging_dir
from slimkit.primitives.files.removal import discard
from slimkit.primitives.io import save, versions
from slimkit.primitives.io.describe import folder_loaders
from slimkit.primitives.io.save import non_finite_tensors
from slimkit.recipes.schema import Recipe


@dataclass(frozen=True)
class RunStart:
    """What the earlier phases measured for the report: placement, the dense widths and MACs, the calibration set's
    description."""

    placement: Placement
    widths_before: list[dict[str, int]]
    macs_before: int
    calibration: dict[str, Any] | None
    memory_plan: MemoryPlan | None = None


def target_outcome(
    recipe: Recipe, dense: dict[str, int], now: dict[str, int], shares: dict[str, float]
) -> TargetOutcome:
    """The report's ``target`` entry: wanted, achieved, tolerance, whether it is met, and each stage's share."""
    target = recipe.target
    achieved = target.achieved(dense, now)
    return TargetOutcome(
        ratio=target.ratio,
        of=target.of,
        achieved=achieved,
        tolerance=target.tolerance,
        strict=target.strict,
        met=target.met(achieved),
        shares=shares,
        align=dict(target.align),
    )


def check_result(
    ctx: Context, start: RunStart, shares: dict[str, float], save_dtype: torch.dtype | None
) -> TargetOutcome:
    """The target met (or flagged), the save dtype applied, the weights finite; returns the target's outcome."""
    recipe = ctx.recipe
    outcome = target_outcome(recipe, ctx.params_before, params_by_part(ctx.model), shares)
    if not outcome.met:
        if recipe.target.strict:
            raise SlimkitError(outcome.missed_message())
        ctx.notes.append(f"target not met: {outcome.missed_message().split('; removed by stage')[0]}")
    calibration = start.calibration
    if calibration and recipe.eval.perplexity and calibration["dataset"] in recipe.eval.perplexity.datasets:
        ctx.notes.append(
            f"calibration and perplexity evaluation both use {calibration['dataset']}: "
            "the perplexity on it is optimistic"
        )
    computed = start.placement.dtype
    if save_dtype is not None and save_dtype != computed:
        ctx.model.to(dtype=save_dtype)
        ctx.notes.append(f"weights computed in {dtype_name(computed)}, saved and evaluated in {dtype_name(save_dtype)}")
    bad, checked = non_finite_tensors(ctx.model)
    if bad:
        cast = f" after the cast to save_dtype {dtype_name(save_dtype)}" if save_dtype is not None else ""
        raise SlimkitError(
            f"{len(bad)} of {checked} tensors hold NaN/inf after the stages{cast} ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); nothing was written"
        )
    return outcome


def finish(
    ctx: Context,
    start: RunStart,
    stages: StagesOutcome,
    save_dtype: torch.dtype | None,
    out_path: Path | None,
    force: bool,
    options: RunOptions,
    timings: Timings,
) -> Result:
    """Check, save, export, evaluate, report and publish; returns the run's :class:`Result`."""
    outcome = check_result(ctx, start, stages.shares, save_dtype)
    staging = None
    exports: list[dict[str, Any]] = []
    try:
        with output_write_errors(out_path):
            staging = staging_dir(out_path) if out_path is not None else None
            exports = save_model(ctx, start, stages.runs, staging, timings) if staging is not None else []
            evaluation, dense = Evaluation(), None
            if options.evaluate:
                evaluation = evaluate_model(ctx.model, ctx.tokenizer, ctx.recipe.eval, ctx.tracker)
                for label, seconds in evaluation.seconds.items():
                    timings.add(label, seconds)
                ctx.notes.extend(evaluation.notes)
                if options.compare_dense:
                    dense = compare_with_dense(ctx, start.placement, save_dtype or start.placement.dtype, timings)
            written = Written(folder_loaders(staging / "model"), exports) if staging is not None else None
            report = build_report(ctx, start, outcome, stages.runs, evaluation, save_dtype, timings, dense, written)
            if staging is not None and out_path is not None:
                from slimkit.engine.report_files import write_report

                for run in stages.runs:
                    for name, writer in run.result.artifacts.items():
                        writer(staging / name)
                write_report(report, staging)
                ctx.tracker.reached("replace")
                for note in output_safety.publish(staging, out_path, force):
                    ctx.tracker.log(note)
    finally:
        if staging is not None:
            discard(staging)
    failed = [item for item in exports if "error" in item]
    if failed:
        raise SlimkitError(
            f"the model and report are in {out_path}, but {len(failed)} export(s) failed: "
            + "; ".join(f"{item['format']} {item['path']}: {item['error']}" for item in failed)
        )
    return Result(ctx.model, ctx.tokenizer, report, out_path)


def stage_manifest(runs: list[StageRun]) -> dict[str, Any]:
    """The manifest entries the stages left (each key once per run)."""
    entries: dict[str, Any] = {}
    for run in runs:
        for key, value in run.result.manifest.items():
            if key in entries:
                raise SlimkitError(
                    f"stage '{run.definition.name}' leaves manifest entry '{key}', which another stage left"
                )
            entries[key] = value
    return entries


def save_model(
    ctx: Context, start: RunStart, runs: list[StageRun], staging: Path, timings: Timings
) -> list[dict[str, Any]]:
    """The model (with its manifest and recipe) into ``staging/model``, then the recipe's exports; returns those."""
    recipe = ctx.recipe
    raw = recipe.source()
    manifest = {
        "recipe_name": recipe.name,
        "recipe": raw,
        "seed": recipe.seed,
        "source": ctx.source,
        "calibration": start.calibration,
        "target": recipe.target.model_dump(),
        **stage_manifest(runs),
    }
    with timings.stage("save"):
        save(ctx.model, ctx.tokenizer, staging / "model", manifest=manifest)
        ctx.tracker.reached("save")  # weights written, recipe and report not yet
        (staging / "model" / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return run_exports(recipe, ctx.model, ctx.tokenizer, staging, timings)


def run_exports(recipe: Recipe, model: Any, tokenizer: Any, folder: Path, timings: Timings) -> list[dict[str, Any]]:
    """The recipe's ``export:`` items, written under ``folder``; a refused export is recorded, not raised
    (the caller reports it after the run's results are safely written)."""
    from slimkit.primitives.export import export

    results = []
    for index, item in enumerate(recipe.export):
        target = folder / item.target()
        with timings.stage(f"export{'' if index == 0 else f'#{index + 1}'}"):
            try:
                if is_offloaded(model):
                    raise SlimkitError("an offloaded model is exported from its saved folder: run slimkit export on it")
                result = export(model, target, item.format, item.type, tokenizer=tokenizer).as_dict()
                result["path"] = item.target()
            except SlimkitError as error:
                result = {"format": item.format, "path": item.target(), "error": str(error)}
        results.append(result)
    return results


def stage_reports(runs: list[StageRun], calibration: dict[str, Any] | None) -> dict[str, StageReport]:
    """Each stage's result as a typed :class:`StageReport`, by stage name in recipe order (``lora#2``: the second
    lora stage of the recipe)."""
    tokens = int((calibration or {}).get("tokens") or 0)
    reports: dict[str, StageReport] = {}
    seen: dict[str, int] = {}
    for run in runs:
        name = run.definition.name
        seen[name] = seen.get(name, 0) + 1
        key = name if seen[name] == 1 else f"{name}#{seen[name]}"
        reports[key] = StageReport.from_stage(dict(run.result.details), run.definition.trains, tokens)
    return reports


@dataclass(frozen=True)
class Written:
    """What the output folder holds besides the report: who can load the saved model, and the exports."""

    loaders: list[Any]
    """:func:`~slimkit.primitives.io.describe.folder_loaders` of the saved model."""
    exports: list[dict[str, Any]]


def build_report(
    ctx: Context,
    start: RunStart,
    outcome: TargetOutcome,
    runs: list[StageRun],
    evaluation: Evaluation,
    save_dtype: torch.dtype | None,
    timings: Timings,
    dense: DenseComparison | None = None,
    written: Written | None = None,
) -> RunReport:
    """The run's report, built once from everything the phases measured (``written``: None when nothing was
    saved)."""
    recipe, placement = ctx.recipe, start.placement
    before, after = ctx.params_before, params_by_part(ctx.model)
    return RunReport(
        recipe=recipe.name,
        model=ctx.source["name"],
        seed=recipe.seed,
        target=outcome,
        params={
            "before": before["total"],
            "after": after["total"],
            "removed_ratio": 1.0 - after["total"] / before["total"],
            "by_part_before": before,
            "by_part_after": after,
        },
        macs={"before": start.macs_before, "after": count_macs(ctx.model, MACS_SEQ_LEN), "seq_len": MACS_SEQ_LEN},
        timings_s=timings.as_dict(),
        peak_rss_mb=peak_rss_mb(),
        placement={
            **placement.describe(),
            "offloaded": is_offloaded(ctx.model),
            "peak_gpu_mb": peak_memory_mb(placement.device),
            "save_dtype": dtype_name(save_dtype) if save_dtype is not None else None,
        },
        metrics=evaluation.metrics,
        evaluation=evaluation.details,
        calibration=start.calibration,
        memory_plan=start.memory_plan.describe() if start.memory_plan is not None else None,
        stages=stage_reports(runs, start.calibration),
        layers={"before": start.widths_before, "after": ModelView(ctx.model).layer_widths()},
        notes=ctx.notes,
        versions=versions(),
        dense=dense,
        loaders=[{"loader": v.loader, "answer": v.answer, "detail": v.detail} for v in written.loaders]
        if written is not None
        else None,
        export=(written.exports or None) if written is not None else None,
    )
