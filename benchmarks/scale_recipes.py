"""The recipes ``python -m benchmarks.scale`` runs: each bundled recipe (or a variant with ``--set`` overrides) at
20% without its recovery stages, its relative cost for ordering, and its memory plan at a shape.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.core.engine_calls import memory_plan
from benchmarks.core.processes import log
from benchmarks.core.recipes import RECOVERY_STAGES, flat_stages, without_stages
from benchmarks.scale_shapes import REAL, Shape

RECIPES = ("lorap", "wanda-channels", "llm-pruner", "sp3-oneshot")
QUICK_RECIPES = ("wanda-channels",)
OFFLOAD_RECIPES = ("wanda-channels", "lorap")
"""Layer-wise recipes only: whole-model stages (Taylor gradients, a global PCA) are refused on an offloaded model."""
RATIO = 0.2


def target_of(shape: Shape, recipe: str) -> str:
    """What the 20% is of: the whole model for the real shapes; the decoder layers for the synthetic ones
    (sweeps, tiny), whose 49,152-word embeddings are a large part of them (20% of a tiny model would be most
    of its layers), so every sweep point removes the same fraction of every layer. SP3's projection narrows
    the embeddings with the layers, so it takes 20% of the model everywhere (its solver needs ``of: model``)."""
    return "model" if REAL.get(shape.name) == shape or recipe.startswith("sp3") else "layers"


VARIANT_SEPARATOR = "@"
"""``--recipes`` takes ``NAME@KEY=VALUE[@KEY=VALUE...]``: the bundled NAME with ``slimkit --set`` overrides."""


def split_variant(recipe: str) -> tuple[str, list[str]]:
    """``"sp3-llm@stages.1.args.learning_rate=0"`` -> ``("sp3-llm", ["stages.1.args.learning_rate=0"])``."""
    name, *overrides = recipe.split(VARIANT_SEPARATOR)
    return name, overrides


def variant_raw(recipe: str) -> dict[str, Any]:
    """The bundled recipe of ``recipe``'s name, parsed, with its overrides applied as ``slimkit recipe run --set``
    would (keys address the recipe as written: stage indices before any stage is dropped)."""
    from slimkit.recipes.loading import apply_override, parse_yaml, recipe_path

    name, overrides = split_variant(recipe)
    path = recipe_path(name)
    raw = parse_yaml(path.read_text(), str(path))
    for assignment in overrides:
        apply_override(raw, assignment)
    return raw


def scale_recipe(recipe: str, samples: int, seq_len: int, of: str = "model") -> tuple[dict[str, Any], list[str]]:
    """The bundled ``recipe`` (with a variant's overrides) for a cost run: 20% of ``of``, not strict, the
    calibration budget, without its recovery stages (:data:`RECOVERY_STAGES`, at the top level or inside
    ``sequential``). The cost run's target and calibration replace what an override set there."""
    raw = variant_raw(recipe)
    raw["target"] = {**(raw.get("target") or {}), "ratio": RATIO, "of": of, "strict": False}
    calibration = dict(raw.get("calibration") or {})
    calibration.update(samples=samples, seq_len=seq_len)
    calibration["batch_size"] = min(int(calibration.get("batch_size") or samples), samples)
    raw["calibration"] = calibration
    if of == "layers":  # LoRAP's layer ratio is defined from the whole model: the same 20% of every layer instead
        for item in raw["stages"]:
            for child in item.get("sequential", []) if isinstance(item, dict) else []:
                child_args = child.setdefault("args", {})
                if child_args.get("ratio_rule") == "layer" or (
                    child["stage"] == "lowrank" and "ratio" not in child_args
                ):
                    child_args.pop("ratio_rule", None)
                    child_args["ratio"] = RATIO
    dropped: list[str] = []
    raw["stages"] = without_stages(raw["stages"], RECOVERY_STAGES, dropped)
    return raw, dropped


_RECIPE_WEIGHT = {"lorap": 3.0, "llm-pruner": 1.0, "wanda-channels": 0.6, "sp3-oneshot": 0.4}
_STAGE_WEIGHT = {
    "prune": 0.5,
    "prune_layer": 0.6,
    "pca_project": 0.4,
    "lowrank": 2.4,
    "reconstruct": 3.0,
    "obs_prune_layer": 2.0,
    "cce": 6.0,
    "prunenet": 8.0,
    "mask_train": 10.0,
}
"""Rough relative stage costs (from the four measured recipes above and the stage times of an 8B run; see
docs/methods/benchmark-harness.md), for ordering only; a gradient scorer doubles prune."""


def recipe_weight(recipe: str) -> float:
    """A recipe's relative cost: the measured factor of the four base recipes, else the sum of its stages'."""
    if recipe in _RECIPE_WEIGHT:
        return _RECIPE_WEIGHT[recipe]
    weight = 0.0
    for stage in flat_stages(variant_raw(recipe)):
        if stage.get("stage") in RECOVERY_STAGES:
            continue
        own = _STAGE_WEIGHT.get(str(stage.get("stage")), 1.0)
        scorer = str((stage.get("args") or {}).get("scorer", ""))
        weight += own * (2.0 if "taylor" in scorer or "coupled" in scorer else 1.0)
    return weight or 1.0


def estimated_cost(shape: Shape, recipe: str, offloaded: bool) -> float:
    """A rough relative cost for ordering (decoder-layer parameters x a per-recipe factor)."""
    return shape.params()["layers"] * recipe_weight(recipe) * (1.5 if offloaded else 1.0)


def planned_peak(
    shape: Shape, recipe: str, args: argparse.Namespace, dtype: str, max_memory: str | None
) -> float | None:
    """Bytes a run needs on its device by the recipe's memory plan (``slimkit.engine.memory_check``, the check
    ``slimkit recipe run`` refuses with before loading), from the shape's config alone: the weights plus the largest
    stage, or for an offloaded run its ``--max-memory`` plus the largest stage; None when no plan can be made."""
    import torch

    from slimkit.primitives.device.placement import parse_size
    from slimkit.recipes.loading import validate

    raw, _dropped = scale_recipe(recipe, args.samples, args.seq_len, target_of(shape, recipe))
    try:
        plan = memory_plan(validate(raw, recipe), shape.config(dtype), getattr(torch, dtype))
    except Exception as error:  # no plan: the row runs alone (it reports its own refusal if the recipe is bad)
        log(f"  {shape.name}/{recipe}: no memory plan ({type(error).__name__}: {error}); it runs alone")
        return None
    if max_memory:
        return parse_size(max_memory) + plan.peak - plan.weights
    return float(plan.peak)
