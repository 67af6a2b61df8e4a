"""The dense model's metrics beside the run's: the recipe's source (for a model slimkit compressed earlier, the dense
model it came from) evaluated under the same settings.

Measured after the stages (so a recipe's bad input still fails before any evaluation) on a fresh load of the source,
in the dtype the compressed model is evaluated in, then cached per source content and settings
(:mod:`slimkit.primitives.evaluate.reference`): only the first run of a source and settings loads it a second time.
The dense model's content is taken when the run loads its source (:func:`dense_content_at_load`) and checked again
before and after it is measured: weights rewritten meanwhile are a note, never compared.
The comparison is optional and never costs the run: a cache problem is a note (measured again or not stored), and a
dense model that cannot be measured any more is a note saying the comparison was skipped and why.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from slimkit.engine.context import Context
from slimkit.engine.progress import Timings
from slimkit.engine.report import DenseComparison
from slimkit.engine.run_result import RunOptions
from slimkit.primitives.device.placement import Placement, dtype_name
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.reference import content_fingerprint, dense_metrics
from slimkit.primitives.evaluate.run import evaluate_model
from slimkit.primitives.finetune.glue_task_model import task_head
from slimkit.primitives.io.model_sources import dense_of, load_source
from slimkit.recipes.schema import Recipe

DENSE_CONTENT = "dense_content"
"""The run source's entry holding the dense model's :func:`content_fingerprint` when the run loaded its source."""


def dense_content_at_load(recipe: Recipe, source: dict[str, Any], options: RunOptions) -> None:
    """Record in ``source`` the dense model's content as the run starts (when it will be compared with), so that a
    comparison measuring other weights is a note instead of a number."""
    settings = recipe.eval
    wanted = settings.perplexity is not None or (settings.zeroshot is not None and bool(settings.zeroshot.tasks))
    if not (options.evaluate and options.compare_dense and wanted) or recipe.task is not None:
        return
    path = dense_of(source).get("path")
    if path is None:
        return
    try:
        source[DENSE_CONTENT] = content_fingerprint(path)
    except (OSError, SlimkitError):
        return  # the comparison names the unreadable files when it runs


def _changed(before: list[list[Any]], now: list[list[Any]]) -> str:
    """The first file whose entry differs between two fingerprints."""
    old, new = {entry[0]: entry for entry in before}, {entry[0]: entry for entry in now}
    return next((name for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)), "a file")


def compare_with_dense(
    ctx: Context, placement: Placement, dtype: torch.dtype, timings: Timings
) -> DenseComparison | None:
    """The dense model's perplexity and zero-shot metrics under the recipe's evaluation settings (GLUE and speed
    left out), from the cache or measured now; None (with a note when it could have been asked for) when the run's
    evaluation has none, the model was given in memory, or it is a task model (its dense head is untrained)."""
    recipe = ctx.recipe
    settings = recipe.eval.model_copy(update={"glue": None, "speed": False})
    if settings.perplexity is None and (settings.zeroshot is None or not settings.zeroshot.tasks):
        return None
    head = task_head(recipe.task)
    if head is not None or ctx.source["path"] is None:
        why = head.no_dense_comparison if head is not None else "an in-memory model has no source"
        ctx.notes.append(f"no dense comparison: {why}")
        return None
    dense = dense_of(ctx.source)
    if dense["path"] is None:
        ctx.notes.append(f"no dense comparison: {dense['missing']}")
        return None
    try:
        with timings.stage("eval:dense"):  # hashing the dense model's files counts as the comparison's time
            files = content_fingerprint(dense["path"])
    except (OSError, SlimkitError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        ctx.notes.append(f"no dense comparison: cannot read the dense model's files in {dense['path']} ({reason})")
        return None
    at_load = ctx.source.get(DENSE_CONTENT)
    if at_load is not None and at_load != files:
        ctx.notes.append(
            f"no dense comparison: the dense model's files in {dense['path']} changed since the run loaded it "
            f"({_changed(at_load, files)}); its metrics would not be the compressed model's origin's"
        )
        return None
    identity = {
        "files": files,
        "device": placement.device.type,
        "dtype": dtype_name(dtype),
        "max_memory": placement.max_memory,
        "eval": settings.model_dump(mode="json"),
    }

    def measure() -> dict[str, float]:
        model, tokenizer, _info = load_source(
            dense["path"], device=str(placement.device), dtype=dtype_name(dtype), max_memory=placement.max_memory
        )
        try:
            now = content_fingerprint(dense["path"])
            if now != files:  # rewritten while it was loaded
                raise SlimkitError(f"its files changed while it was loaded ({_changed(files, now)})")
            return evaluate_model(model, tokenizer, settings, ctx.tracker).metrics
        finally:
            del model
            gc.collect()
            if placement.device.type == "cuda":
                torch.cuda.empty_cache()

    with timings.stage("eval:dense"):
        try:
            metrics, use = dense_metrics(identity, measure)
        except SlimkitError as error:  # the dense model changed or went away since the run started
            ctx.notes.append(f"no dense comparison: the dense model could not be measured ({error})")
            return None
    ctx.notes.extend(use.notes)
    return DenseComparison(metrics=metrics, cached=use.cached)
