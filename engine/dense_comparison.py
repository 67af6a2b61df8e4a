"""The dense model's metrics beside the run's: the recipe's source (for a model slimkit compressed earlier, the dense
model it came from) evaluated under the same settings.

Measured after the stages (so a recipe's bad input still fails before any evaluation) on a fresh load of the source,
in the dtype the compressed model is evaluated in, then cached per source and settings
(:mod:`slimkit.primitives.evaluate.reference`): only the first run of a source and settings loads it a second time.
"""

from __future__ import annotations

import gc

import torch

from slimkit.engine.context import Context
from slimkit.engine.progress import Timings
from slimkit.engine.report import DenseComparison
from slimkit.primitives.device.placement import Placement, dtype_name
from slimkit.primitives.evaluate.reference import dense_metrics, source_fingerprint
from slimkit.primitives.evaluate.run import evaluate_model
from slimkit.primitives.io.model_sources import dense_of, load_source


def compare_with_dense(
    ctx: Context, placement: Placement, dtype: torch.dtype, timings: Timings
) -> DenseComparison | None:
    """The dense model's perplexity and zero-shot metrics under the recipe's evaluation settings (GLUE and speed
    left out), from the cache or measured now; None (with a note when it could have been asked for) when the run's
    evaluation has none, the model was given in memory, or it is a GLUE task model (its dense head is untrained)."""
    recipe = ctx.recipe
    settings = recipe.eval.model_copy(update={"glue": None, "speed": False})
    if settings.perplexity is None and (settings.zeroshot is None or not settings.zeroshot.tasks):
        return None
    if recipe.task is not None or ctx.source["path"] is None:
        why = "a GLUE task model's dense head is untrained" if recipe.task else "an in-memory model has no source"
        ctx.notes.append(f"no dense comparison: {why}")
        return None
    dense = dense_of(ctx.source)
    if dense["path"] is None:
        ctx.notes.append(f"no dense comparison: {dense['missing']}")
        return None
    identity = {
        "source": {"name": dense["name"], "path": dense["path"]},
        "files": source_fingerprint(dense["path"]),
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
            return evaluate_model(model, tokenizer, settings, ctx.tracker).metrics
        finally:
            del model
            gc.collect()
            if placement.device.type == "cuda":
                torch.cuda.empty_cache()

    with timings.stage("eval:dense"):
        metrics, cached = dense_metrics(identity, measure)
    return DenseComparison(metrics=metrics, cached=cached)
