"""Executing a recipe: load, calibrate, run stages, save, evaluate, report.

The output folder ``OUT`` (``--out``) is handled safely:

* it is checked before the model is loaded (:func:`check_output_dir`): never the filesystem root, the home
  folder, the working directory or one of its parents; its parent must be writable; a non-empty ``OUT`` needs
  ``force``, which replaces only a slimkit output;
* one run at a time writes ``OUT``: the run holds the lock ``.OUT.lock`` beside it (:func:`_claimed_output`);
  a second run fails at once, naming the first one's pid;
* everything is written to a hidden sibling ``.OUT.partial-PID-XXXX`` and put in place at the end in one step
  (:func:`publish`), so ``OUT`` always holds the whole old result or the whole new one; an interrupted run
  (Ctrl-C, or SIGTERM, which is handled like Ctrl-C) deletes its partial folder; those of killed runs are
  deleted by the next run to the same ``OUT``.

Test hook: ``SLIMKIT_TEST_PAUSE_AT`` (see :func:`_pause_for_test`).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from slimkit.primitives.io.save import MANIFEST_NAME, non_finite_tensors
from slimkit.primitives.offload import check_stage_fits, is_offloaded
from slimkit.primitives.paths import LockHeld, acquire_lock, remove_leftovers, staging_dir, swap_in
from slimkit.primitives.placement import (
    DTYPES,
    Placement,
    dtype_name,
    peak_memory_mb,
    reset_peak_memory,
    resolve_device,
)
from slimkit.primitives.sources import load_source
from slimkit.recipes.context import Context
from slimkit.recipes.layerwise import run_layerwise
from slimkit.recipes.memory_plan import check_memory_plan, memory_errors
from slimkit.recipes.progress import Tracker
from slimkit.recipes.registry import stage_def
from slimkit.recipes.schema import CalibrationConfig, EvalConfig, Recipe, SequentialSpec, is_glue_dataset

MACS_SEQ_LEN = 128


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse, before anything is loaded or computed, an ``--out`` this run must not or cannot write.

    Never the filesystem root, the home folder, the working directory or one of its parents (see
    :func:`protected_reason`), nor a symbolic link or a file; the folder it is written in must be writable. A
    non-empty ``out`` needs ``force``, and ``force`` replaces only a slimkit output (:func:`is_slimkit_output`).
    """
    try:
        _check_output_path(out, force)
    except OSError as error:
        raise SlimkitError(f"--out {out}: cannot inspect it ({error.strerror})") from None


def _check_output_path(out: Path, force: bool) -> None:
    reason = protected_reason(out)
    if reason is not None:
        raise SlimkitError(f"--out {out} is {reason}, which a run never replaces; name a folder for its output")
    if out.name in ("", ".", ".."):
        raise SlimkitError(f"--out {out}: end the path with the output folder's own name, not . or ..")
    if out.is_symlink():
        raise SlimkitError(f"--out {out} is a symbolic link; name the folder itself, or a new one")
    if out.exists() and not out.is_dir():
        raise SlimkitError(f"--out {out} exists and is not a directory")
    check_writable(out, force)
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, force)


def protected_reason(out: Path) -> str | None:
    """Why ``out`` may never be a run's output folder, or None: it resolves to the filesystem root, the home
    folder, the current working directory or a parent of it."""
    resolved = out.resolve()
    if resolved == Path(resolved.anchor):
        return "the filesystem root"
    try:
        if resolved == Path.home().resolve():
            return "the home folder"
    except (RuntimeError, KeyError):  # no home folder known
        pass
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:  # the working directory was deleted
        return None
    if resolved == cwd:
        return "the current working directory"
    if cwd.is_relative_to(resolved):
        return "a parent of the current working directory"
    return None


def check_writable(out: Path, force: bool) -> None:
    """The folder ``out`` is written in (its nearest existing ancestor) must be a folder this process may write
    in; an ``out`` that ``force`` will replace must be writable too."""
    ancestor = out.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SlimkitError(f"--out {out}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SlimkitError(f"--out {out}: no permission to write in {ancestor}")
    if force and out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise SlimkitError(f"--out {out}: no permission to replace it (the folder is not writable)")


def is_slimkit_output(folder: Path) -> bool:
    """Whether ``folder`` holds what slimkit writes: a run's output (``report.json`` or
    ``model/slimkit_manifest.json``) or a saved model (``slimkit_manifest.json``)."""
    return any((folder / name).is_file() for name in ("report.json", f"model/{MANIFEST_NAME}", MANIFEST_NAME))


def check_replaceable(out: Path, force: bool) -> None:
    """A non-empty ``out`` is replaced only with ``force`` and only when it is a slimkit output."""
    if not force:
        raise SlimkitError(f"--out {out}: output directory exists and is not empty (use --force to replace it)")
    if not is_slimkit_output(out):
        example = min(entry.name for entry in out.iterdir())
        raise SlimkitError(
            f"--out {out} is not a slimkit output (it holds {example}, and no report.json or "
            f"model/{MANIFEST_NAME}); --force replaces only slimkit outputs and empty folders"
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run, raised like Ctrl-C so the run cleans up (partial folder, lock) before exiting."""


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While a run writes, SIGTERM raises :class:`Terminated` as Ctrl-C raises KeyboardInterrupt: only when the
    process has no SIGTERM handler of its own, and only in the main thread (where Python runs handlers)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _raise(_signum, _frame):
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then raise them again (they act as usual): for steps never
    to be cut in two. Python handlers are swapped, not the signal mask: a signal sent to the process may land
    on any of its threads (torch's among them), and Python runs every handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not None]
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in received:
            signal.raise_signal(sig)


@contextmanager
def _claimed_output(out: Path, force: bool, tracker: Tracker) -> Iterator[list[str]]:
    """Hold ``out``'s lock for the whole run (released however it ends); then clean what killed runs left
    beside ``out`` and check ``out`` again, now that no other run writes it. Yields the clean-up notes."""
    try:
        lock = acquire_lock(out)
    except LockHeld as held:
        raise SlimkitError(
            f"--out {out} is being written by another slimkit run (pid {held.pid or 'unknown'})"
        ) from None
    except OSError as error:
        raise SlimkitError(f"--out {out}: cannot create the lock file beside it ({error.strerror})") from None
    try:
        notes = remove_leftovers(out)
        for note in notes:
            tracker.log(note)
        try:
            check_output_dir(out, force)
        except SlimkitError as error:
            raise SlimkitError(f"{error} ({'; '.join(notes)})" if notes else str(error)) from None
        yield notes
    finally:
        lock.release()


def publish(staging: Path, out: Path, force: bool) -> None:
    """Put the finished ``staging`` folder at ``out`` in one step, after checking ``out`` once more (something
    may have written there during the run); the previous result is deleted only once the new one is in place."""
    try:
        check_output_dir(out, force)
    except SlimkitError as error:
        raise SlimkitError(f"{error}; it changed while this run computed, so nothing was written") from None
    aside = None
    try:
        with _signals_deferred():
            aside = swap_in(staging, out)
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


PAUSE_AT = "SLIMKIT_TEST_PAUSE_AT"


def _pause_for_test(point: str) -> None:
    """Test hook: with ``SLIMKIT_TEST_PAUSE_AT=point`` print ``slimkit: paused at POINT`` on stderr and sleep
    ``SLIMKIT_TEST_PAUSE_S`` seconds (default 60), so a test can signal the run at that moment. Points:
    ``compute`` (calibrated, before the stages run), ``save`` (the weights are written into the partial folder,
    the recipe and report not yet) and ``replace`` (the new output is complete in its partial folder, before it
    replaces ``out``)."""
    if os.environ.get(PAUSE_AT) != point:
        return
    print(f"slimkit: paused at {point}", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("SLIMKIT_TEST_PAUSE_S", "60")))


class Timings:
    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with memory_errors(label):  # an out-of-memory error becomes one error line naming the stage
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


def _block_plan(ctx: Context, children: list) -> int:
    """Parameters the block's fixed-budget stages plan to remove (a solve stage in it subtracts them)."""
    planned = 0
    for spec in children:
        definition = stage_def(spec.stage)
        args = spec.parsed_args()
        if definition.plan is not None and definition.budget(args) in ("explicit", "layer"):
            planned += definition.plan(ctx, args)
    return planned


def _run_stages(ctx: Context, recipe: Recipe, timings: Timings, tracker: Tracker) -> dict[str, float]:
    """Run every stage; returns each top-level stage's share: the fraction of the dense target part it removed."""
    part = recipe.target.part
    shares: dict[str, float] = {}
    for index, item in enumerate(recipe.stages):
        before = params_by_part(ctx.model)[part]
        if isinstance(item, SequentialSpec):
            label = f"{index}:sequential[{','.join(s.stage for s in item.sequential)}]"
            children, propagate = item.sequential, "compressed"
        else:
            label = f"{index}:{item.stage}"
            children, propagate = [item], "dense"
        ctx.start_block()
        ctx.block_planned = _block_plan(ctx, children)
        definition = stage_def(children[0].stage)
        if not isinstance(item, SequentialSpec) and definition.scope == "model":
            with timings.stage(label):
                definition.fn(ctx, item.parsed_args())
        elif not isinstance(item, SequentialSpec) and definition.top_level is not None:
            with timings.stage(label):  # a layer stage's own top-level form (reconstruct)
                definition.top_level(ctx, item.parsed_args(), index)
        else:
            with timings.stage(label), tracker.task(label, ctx.view.num_layers) as advance:
                run_layerwise(ctx, children, propagate, on_layer=lambda _i: advance(1))
        shares[label] = (before - params_by_part(ctx.model)[part]) / ctx.params_before[part]
    return shares


def target_outcome(recipe: Recipe, dense: dict[str, int], now: dict[str, int], shares: dict[str, float]) -> dict:
    """The report's ``target`` entry: wanted, achieved, tolerance, whether it is met, and each stage's share."""
    target = recipe.target
    achieved = target.achieved(dense, now)
    return {
        "ratio": target.ratio,
        "of": target.of,
        "achieved": achieved,
        "tolerance": target.tolerance,
        "strict": target.strict,
        "met": target.met(achieved),
        "shares": shares,
    }


def missed_target_message(outcome: dict) -> str:
    shares = ", ".join(f"{label} {share:.2%}" for label, share in outcome["shares"].items())
    return (
        f"target missed: {outcome['ratio']:.1%} of {outcome['of']} wanted, {outcome['achieved']:.2%} achieved "
        f"(tolerance {outcome['tolerance']:.1%}); removed by stage: {shares or 'none'}. Nothing was written; "
        "adjust the stages' explicit ratios, or set target.strict: false to keep such a result"
    )


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


@dataclass
class Result:
    """What :func:`run` returns: the compressed model, its tokenizer, the report, and the output folder."""

    model: Any
    tokenizer: Any
    report: dict[str, Any]
    out: Path | None = None


def run(
    recipe: Recipe,
    out: str | os.PathLike | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    force: bool = False,
    run_eval: bool = True,
    tracker: Tracker | None = None,
) -> Result:
    """Run ``recipe``; with ``out`` also write ``out/model``, ``out/report.json`` and ``out/report.md``.

    ``model`` (with ``tokenizer``) compresses a model already in memory instead of loading the recipe's
    source. A target missed by more than its tolerance raises :class:`SlimkitError` (nothing is written)
    unless ``target.strict`` is false.
    """
    tracker = tracker or Tracker()
    if out is None:
        if recipe.export:
            raise SlimkitError("export: writes inside the run's output folder; give the run an output folder")
        return _execute(recipe, None, False, [], model, tokenizer, run_eval, tracker)
    out_path = Path(out)
    check_output_dir(out_path, force)
    with _terminate_as_interrupt(), _claimed_output(out_path, force, tracker) as notes:
        return _execute(recipe, out_path, force, notes, model, tokenizer, run_eval, tracker)


def _execute(
    recipe: Recipe,
    out_path: Path | None,
    force: bool,
    notes: list[str],
    model: Any,
    tokenizer: Any,
    run_eval: bool,
    tracker: Tracker,
) -> Result:
    """The run itself, once ``out_path`` (if any) is checked and claimed; ``notes`` start the report's notes."""
    preflight_data(recipe.eval if run_eval else EvalConfig(perplexity=None), recipe.calibration_config())
    timings = Timings()
    torch.manual_seed(recipe.seed)

    placement = model_placement(recipe, model)
    check_stage_dtypes(recipe, placement.dtype)
    check_memory_plan(recipe, placement, model)  # refuses before loading when the plan does not fit
    reset_peak_memory(placement.device)
    with timings.stage("load"):
        model, tokenizer, source = _load(recipe, placement, model, tokenizer)
    check_export_model(recipe, model)
    check_calibration_length(recipe, model)
    if run_eval:
        check_eval_model(recipe, model)
    ctx = Context(
        recipe=recipe,
        model=model,
        tokenizer=tokenizer,
        source=source,
        generator=torch.Generator().manual_seed(recipe.seed),
        tracker=tracker,
        notes=list(notes),
    )
    return _compress(ctx, placement, out_path, force, timings, run_eval)


def check_eval_model(recipe: Recipe, model: Any) -> None:
    """Refuse, before any compression, perplexity or zero-shot evaluation of an encoder (no language-model head)."""
    from slimkit.primitives.arch.support import task_of

    if recipe.task is not None or task_of(model.config) != "encoder":
        return
    wanted = [
        name for name, config in (("perplexity", recipe.eval.perplexity), ("zeroshot", recipe.eval.zeroshot)) if config
    ]
    if wanted:
        raise SlimkitError(
            f"eval.{wanted[0]}: needs a causal language model, and this run's model is an encoder; set "
            f"eval.{wanted[0]}: null, or give the recipe a GLUE task (task: sst2) and eval.glue"
        )


def check_calibration_length(recipe: Recipe, model: Any) -> None:
    """Refuse, before calibrating, a ``calibration.seq_len`` longer than the model's positions
    (its config's ``max_position_embeddings``, when it has one)."""
    config = recipe.calibration_config()
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if config is None or not isinstance(limit, int) or config.seq_len <= limit:
        return
    raise SlimkitError(
        f"calibration.seq_len: {config.seq_len} is longer than the model's max_position_embeddings ({limit}); "
        f"use at most {limit}"
    )


def check_export_model(recipe: Recipe, model: Any) -> None:
    """Refuse, before any compression, an ``export:`` item the model's type can never satisfy."""
    from slimkit.primitives.export import EXPORTABLE_MODEL_TYPES, HF_MODEL_TYPES

    model_type = getattr(model.config, "model_type", None)
    for index, item in enumerate(recipe.export):
        allowed = EXPORTABLE_MODEL_TYPES if item.format == "gguf" else HF_MODEL_TYPES
        if model_type not in allowed or recipe.task is not None:
            raise SlimkitError(
                f"export.{index}: format {item.format} writes {', '.join(allowed)} language models; "
                f"this run's model is {'a GLUE task model' if recipe.task else repr(model_type)}"
            )


def _load(recipe: Recipe, placement: Placement, model: Any, tokenizer: Any):
    """``(model, tokenizer, source)``: the recipe's source loaded as ``placement`` says, or the given model.

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
    else:
        source = {"name": "in-memory model", "path": None}
    if recipe.task is not None:
        from slimkit.primitives.finetune.glue import task_model

        model = task_model(model, recipe.task, seed=recipe.seed)
    if tokenizer is None:
        raise SlimkitError(f"model source '{source['name']}' has no tokenizer")
    return model, tokenizer, source


def model_placement(recipe: Recipe, model: Any = None) -> Placement:
    """Where the run computes: the recipe's ``model`` fields, or the given in-memory model's own device and
    dtype (a recipe that names another device or dtype for it is refused: nothing is moved silently)."""
    settings = recipe.model
    if model is None:
        return Placement.resolve(settings.device, settings.dtype, settings.max_memory)
    first = next(model.parameters())
    if settings.max_memory is not None:
        raise SlimkitError("model.max_memory applies when slimkit loads the model, not to a model given in memory")
    for field, wanted, actual in (("device", settings.device, first.device), ("dtype", settings.dtype, first.dtype)):
        if wanted != "auto":
            resolved = resolve_device(wanted) if field == "device" else DTYPES[wanted]
            if resolved != actual and not (field == "device" and resolved.type == actual.type == "cuda"):
                raise SlimkitError(
                    f"model.{field}: the recipe asks for {wanted} but the model given has {actual}; "
                    f"move or cast the model first, or leave model.{field}: auto"
                )
    return Placement(first.device, first.dtype)


def check_stage_dtypes(recipe: Recipe, dtype: torch.dtype) -> None:
    """Refuse stages that cannot run with the weights' dtype, before anything is loaded."""
    if dtype != torch.float16:
        return
    for spec in recipe.flat_stages():
        if stage_def(spec.stage).trains:
            raise SlimkitError(
                f"stage '{spec.stage}' trains through the model, which float16 weights cannot do without loss "
                "scaling (activations and gradients overflow or underflow); use model.dtype bfloat16 or float32"
            )


def _check_offloaded_stages(ctx: Context) -> None:
    """Whole-model stages cannot run on an offloaded model: refuse them before any compute."""
    if not is_offloaded(ctx.model):
        return
    for item in ctx.recipe.stages:
        if not isinstance(item, SequentialSpec):
            check_stage_fits(ctx.model, item.stage, stage_def(item.stage).scope)


def _compress(
    ctx: Context, placement: Placement, out_path: Path | None, force: bool, timings: Timings, run_eval: bool
) -> Result:
    recipe, model, tokenizer, tracker = ctx.recipe, ctx.model, ctx.tokenizer, ctx.tracker
    save_dtype = DTYPES[recipe.model.save_dtype] if recipe.model.save_dtype else None
    _check_offloaded_stages(ctx)
    if save_dtype is not None and save_dtype != placement.dtype and is_offloaded(model):
        raise SlimkitError("model.save_dtype: an offloaded model is saved in its own dtype; leave save_dtype unset")
    ctx.params_before = params_by_part(model)
    widths_before = ctx.view.layer_widths()
    macs_before = count_macs(model, MACS_SEQ_LEN)

    with timings.stage("calibration"):
        calibration = _calibrate(ctx, recipe)
    _pause_for_test("compute")
    shares = _run_stages(ctx, recipe, timings, tracker)

    params_after = params_by_part(ctx.model)
    outcome = target_outcome(recipe, ctx.params_before, params_after, shares)
    if not outcome["met"]:
        if recipe.target.strict:
            raise SlimkitError(missed_target_message(outcome))
        ctx.notes.append(f"target not met: {missed_target_message(outcome).split('; removed by stage')[0]}")
    if calibration and recipe.eval.perplexity and calibration["dataset"] in recipe.eval.perplexity.datasets:
        ctx.notes.append(
            f"calibration and perplexity evaluation both use {calibration['dataset']}: "
            "the perplexity on it is optimistic"
        )
    if save_dtype is not None and save_dtype != placement.dtype:
        ctx.model.to(dtype=save_dtype)
        ctx.notes.append(
            f"weights computed in {dtype_name(placement.dtype)}, saved and evaluated in {dtype_name(save_dtype)}"
        )
    bad, checked = non_finite_tensors(ctx.model)
    if bad:
        cast = f" after the cast to save_dtype {dtype_name(save_dtype)}" if save_dtype is not None else ""
        raise SlimkitError(
            f"{len(bad)} of {checked} tensors hold NaN/inf after the stages{cast} ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); nothing was written"
        )
    raw = recipe.source()
    staging = staging_dir(out_path) if out_path is not None else None
    try:
        if staging is not None:
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
                _pause_for_test("save")  # weights written, recipe and report not yet
                (staging / "model" / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
            exports = run_exports(recipe, ctx.model, tokenizer, staging, timings)
        else:
            exports = []
        metrics, details = evaluate(ctx.model, tokenizer, recipe.eval, tracker, timings) if run_eval else ({}, {})
        report = {
            "recipe": recipe.name,
            "model": ctx.source["name"],
            "seed": recipe.seed,
            "target": outcome,
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
            "placement": {
                **placement.describe(),
                "offloaded": is_offloaded(ctx.model),
                "peak_gpu_mb": peak_memory_mb(placement.device),
                **({"save_dtype": dtype_name(save_dtype)} if save_dtype is not None else {}),
            },
            "metrics": metrics,
            "evaluation": details,
            "calibration": calibration,
            "stages": ctx.stage_report,
            "layers": {"before": widths_before, "after": ModelView(ctx.model).layer_widths()},
            "notes": ctx.notes,
            "versions": versions(),
        }
        if staging is not None:
            from slimkit.primitives.io.describe import folder_loaders

            report["loaders"] = [
                {"loader": v.loader, "answer": v.answer, "detail": v.detail} for v in folder_loaders(staging / "model")
            ]
        if exports:
            report["export"] = exports
        if staging is not None and out_path is not None:
            from slimkit.recipes.report import write_report

            for name, writer in ctx.artifacts.items():
                writer(staging / name)
            write_report(report, staging)
            _pause_for_test("replace")
            publish(staging, out_path, force)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    failed = [item for item in exports if "error" in item]
    if failed:
        raise SlimkitError(
            f"the model and report are in {out_path}, but {len(failed)} export(s) failed: "
            + "; ".join(f"{item['format']} {item['path']}: {item['error']}" for item in failed)
        )
    return Result(ctx.model, tokenizer, report, out_path)


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


def run_recipe(
    recipe: Recipe,
    raw: dict[str, Any] | None,
    out: Path,
    force: bool = False,
    run_eval: bool = True,
    tracker: Tracker | None = None,
) -> dict[str, Any]:
    """Run ``recipe`` and write ``out/model``, ``out/report.json``, ``out/report.md``; returns the report.

    ``raw`` (the mapping the recipe came from, saved as ``recipe.yaml``) is kept for callers that built
    the recipe themselves; a recipe remembers its own source otherwise.
    """
    if raw is not None:
        recipe._source = raw
    return run(recipe, out, force=force, run_eval=run_eval, tracker=tracker).report
