"""Executing a recipe, in five phases: preflight, load, calibrate, stages, finish.

* preflight: the output folder (:mod:`slimkit.engine.output_safety`), data files, placement and stage dtypes
  (:mod:`slimkit.engine.preflight`), all before the model is loaded;
* load: the recipe's source (or the model given in memory), then the checks that need the model;
* calibrate: the calibration batches every stage shares;
* stages: each top-level item in its stage form (:mod:`slimkit.engine.dispatch`);
* finish (:mod:`slimkit.engine.finish`): the target checked, weights checked finite, model saved and exported,
  evaluated beside the dense model's metrics (:mod:`slimkit.engine.dense_comparison`), the typed report
  (:class:`~slimkit.engine.report.RunReport`) written, and the output folder published in one step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from slimkit.engine import finish, output_safety, preflight
from slimkit.engine.context import Context
from slimkit.engine.dense_comparison import dense_content_at_load
from slimkit.engine.dispatch import run_stages
from slimkit.engine.error_translation import run_errors
from slimkit.engine.memory_check import check_memory_plan
from slimkit.engine.processes import agree_on_inputs, collective_errors, join_processes
from slimkit.engine.progress import Timings, Tracker
from slimkit.engine.report import MACS_SEQ_LEN
from slimkit.engine.run_result import Result, RunOptions
from slimkit.primitives.calibration import calibration_batches
from slimkit.primitives.device.memory_model import MemoryPlan
from slimkit.primitives.device.placement import Placement, dtype_name, reset_peak_memory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import count_macs, params_by_part
from slimkit.primitives.evaluate.run import preflight_eval_data
from slimkit.primitives.files.guard import terminate_as_interrupt
from slimkit.primitives.finetune.glue_task_model import task_head
from slimkit.primitives.io.finite import check_finite_weights
from slimkit.primitives.io.model_sources import dense_origin, load_source
from slimkit.primitives.io.paths import as_path
from slimkit.recipes.schema import Recipe


def run(
    recipe: Recipe,
    out: str | os.PathLike | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    force: bool = False,
    options: RunOptions | None = None,
    tracker: Tracker | None = None,
) -> Result:
    """Run ``recipe``; with ``out`` also write ``out/model``, ``out/report.json`` and ``out/report.md``.

    ``model`` (with ``tokenizer``) compresses a model already in memory instead of loading the recipe's
    source. A target missed by more than its tolerance raises :class:`SlimkitError` (nothing is written)
    unless ``target.strict`` is false.
    """
    tracker = tracker or Tracker()
    options = options or RunOptions()
    processes = join_processes()
    agree_on_inputs(processes, recipe, model)  # launched processes refuse together when their inputs differ
    if not processes.main:  # launched processes beside the main one: compute, never write (see engine/processes.py)
        others = RunOptions(evaluate=False, compare_dense=False)
        checkpoints = output_safety.checkpoint_root(as_path(out, "out")) if out is not None else None
        return _execute(recipe, None, False, [], model, tokenizer, others, Tracker(), checkpoints)
    if out is None:
        if recipe.export:
            raise SlimkitError("export: writes inside the run's output folder; give the run an output folder")
        return _execute(recipe, None, False, [], model, tokenizer, options, tracker)
    out_path = as_path(out, "--out")
    preflight.check_recipe_saveable(recipe)
    inputs = output_safety.source_inputs(recipe.model.source) if model is None else []
    output_safety.check_output_dir(out_path, force, inputs)
    preflight.check_output_paths(recipe, out_path)
    with terminate_as_interrupt(), output_safety.claimed_output(out_path, force, tracker, inputs) as notes:
        return _execute(recipe, out_path, force, notes, model, tokenizer, options, tracker)


def _execute(
    recipe, out_path, force, notes, model, tokenizer, options: RunOptions, tracker: Tracker, checkpoints=None
) -> Result:
    """The run itself, once ``out_path`` (if any) is checked and claimed; ``notes`` start the report's notes.
    ``checkpoints``: where training stages keep checkpoints when there is no ``out_path`` (a non-main process)."""
    placement, memory_plan = _preflight(recipe, model, options)
    timings = Timings()
    # an out-of-memory error in a step, a failed collective among launched processes: one line naming it
    with run_errors(timings), collective_errors(join_processes()):
        reset_peak_memory(placement.device)
        with timings.stage("load"):
            ctx = _load(recipe, placement, model, tokenizer, tracker, notes, options)
        ctx.checkpoints = output_safety.checkpoint_root(out_path) if out_path is not None else checkpoints
        preflight.check_offloaded_stages(recipe, ctx.model)
        save_dtype = preflight.check_save_dtype(recipe, placement, ctx.model)
        ctx.params_before = params_by_part(ctx.model)
        preflight.check_target_reachable(ctx)  # on shapes alone: an unreachable (aligned) target, before calibration
        widths_before = ctx.view.layer_widths()
        macs_before = count_macs(ctx.model, MACS_SEQ_LEN)
        with timings.stage("calibration"):
            calibration = _calibrate(ctx)
        tracker.reached("compute")
        stages = run_stages(ctx, timings)
        start = finish.RunStart(placement, widths_before, macs_before, calibration, memory_plan)
        result = finish.finish(ctx, start, stages, save_dtype, out_path, force, options, timings)
    if out_path is not None:  # published: nothing is left to resume
        for line in output_safety.remove_checkpoints(out_path):
            tracker.log(line)
    return result


def _preflight(recipe: Recipe, model: Any, options: RunOptions) -> tuple[Placement, MemoryPlan | None]:
    """Everything checked before the model is loaded: data files, placement, stage dtypes, the memory plan (returned
    for the report; None where no plan is made)."""
    preflight.preflight_calibration_data(recipe.calibration_config())
    if options.evaluate:
        preflight_eval_data(recipe.eval)
    torch.manual_seed(recipe.seed)
    placement = preflight.model_placement(recipe, model)
    preflight.check_stage_dtypes(recipe, placement.dtype)
    memory_plan = check_memory_plan(recipe, placement, model)  # refuses before loading when the plan does not fit
    return placement, memory_plan


def _load(recipe, placement, model, tokenizer, tracker, notes, options: RunOptions) -> Context:
    """The recipe's source loaded as ``placement`` says (or the given model), checked, in a fresh :class:`Context`.

    An offloaded model's folder (accelerate's disk offload) lives as long as the model (see :func:`slimkit.load`).
    """
    if model is None:
        model, loaded_tokenizer, info = load_source(
            recipe.model.source,
            device=str(placement.device),
            dtype=dtype_name(placement.dtype),
            max_memory=placement.max_memory,
        )
        tokenizer = tokenizer or loaded_tokenizer
        source = {"name": info.name, "path": info.path}
        origin = dense_origin(info.path)
        if origin is not None:
            source["compressed_from"] = origin
            notes.append(
                f"the model is a slimkit output compressed from {origin['name']}: the dense comparison, a distill "
                f"teacher and a top-level reconstruct use {origin['name']}; the target counts this model's "
                f"{sum(p.numel() for p in model.parameters()):,} parameters"
            )
        dense_content_at_load(recipe, source, options)  # what the dense comparison must measure
    else:
        source = {"name": "in-memory model", "path": None}
    check_finite_weights(model, f"model {source['name']}")  # before any compute reads a NaN weight
    head = task_head(recipe.task)
    if head is not None:
        model = head.wrap(model, recipe.seed)
    if tokenizer is None:
        raise SlimkitError(f"model source '{source['name']}' has no tokenizer")
    preflight.check_dense_reachable(recipe, source)
    preflight.check_export_model(recipe, model)
    preflight.check_stage_models(recipe, model)
    preflight.check_calibration_length(recipe, model)
    if options.evaluate:
        preflight.check_eval_model(recipe, model)
    generator = torch.Generator().manual_seed(recipe.seed)
    return Context(recipe, model, tokenizer, source, generator, tracker=tracker, notes=list(notes))


def _calibrate(ctx: Context) -> dict[str, Any] | None:
    """The calibration batches every stage shares (``ctx.calibration``); returns their description for the report."""
    config = ctx.recipe.calibration_config()
    if config is None:
        return None
    spec = config.spec(ctx.recipe.seed)
    ctx.calibration = calibration_batches(ctx.tokenizer, spec)
    return spec.describe()
