"""Reconstruction stage: refit a layer's consumer projections after units were removed (issue #17).

Inside ``sequential``, after a stage that removed units of a layer (``prune_layer`` with any scorer,
for MLP channels or attention heads), ``reconstruct`` refits the projections that *read* the removed
units, ``down_proj`` for MLP channels and ``o_proj`` for heads, so the layer's output on the
calibration inputs matches the dense layer's:

    W' = argmin ||W X - W' X_K||^2 + lambda ||W'||^2 = W G[:, K] (G[K, K] + lambda I)^-1

with ``G = X X^T`` the Gram matrix of the projection's dense inputs, accumulated (float64) in the
block's statistics pass before any stage changed the layer, ``K`` the kept input columns and
``lambda = damping x mean(diag G[K, K])`` (:func:`slimkit.primitives.reconstruct.refit_least_squares`).
By default the ridge pulls towards the pruned weight's own kept columns (``toward: kept``,
``||W' - W[:, K]||^2``), not towards zero: the plain refit over-fits a few thousand calibration tokens
(down_proj has 1,100-1,500 inputs on smollm2), and shrinking towards zero hurts more (measured).

Kept columns are found by matching: removal slices whole columns without changing them, so every
column of the pruned projection equals one dense column (matched in order). A projection whose
columns were changed by another stage (a low-rank pair, a projection) is refused in one line. With
nothing removed the weight is left as it is.

Inside ``sequential`` the inputs are the compressed predecessors' outputs, so each layer is refitted
against its own dense output on what it actually receives. The report gives, per role, the relative
output error ``tr(dW G dW^T) / tr(W G W^T)`` of the pruned projection before and after the refit.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from slimkit.primitives.arch import LayerView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import LowRankLinear
from slimkit.primitives.reconstruct import embed_columns, output_error, refit_least_squares
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict

Consumer = Literal["down", "o"]


class ReconstructArgs(Strict):
    roles: list[Consumer] = Field(default_factory=lambda: ["down", "o"], min_length=1)
    """Projections to refit: down (reads the MLP channels) and o (reads the attention heads)."""
    damping: float = Field(default=0.1, ge=0)
    """Ridge damping as a fraction of the mean diagonal of the kept inputs' Gram matrix."""
    toward: Literal["zero", "kept"] = "kept"
    """What the ridge pulls towards: the pruned weight's own kept columns (a large damping then leaves the pruned
    weight as it was) or zero (plain ridge). Measured on smollm2 at 20% (benchmarks/results/2026-11-23-reconstruct.md):
    the plain refit (zero, 1e-6) over-fits 4,096 calibration tokens for down_proj; kept with 0.1 did best."""


def matched_columns(dense: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor | None:
    """Indices ``K`` (ascending) with ``pruned == dense[:, K]`` exactly, or None when the columns do not match."""
    if pruned.shape[0] != dense.shape[0] or pruned.shape[1] > dense.shape[1]:
        return None
    kept = []
    position = 0
    for column in range(pruned.shape[1]):
        target = pruned[:, column]
        while position < dense.shape[1] and not torch.equal(dense[:, position], target):
            position += 1
        if position == dense.shape[1]:
            return None
        kept.append(position)
        position += 1
    return torch.tensor(kept, dtype=torch.long)


def _refit_role(layer: LayerView, role: Consumer, stats: dict, damping: float, toward: str = "zero") -> dict | None:
    module = layer.linear(role)
    if isinstance(module, LowRankLinear):
        raise SlimkitError(f"reconstruct: layer {layer.index} {role} is a low-rank pair; refit its factors instead")
    snapshot = stats["dense_consumers"][role]
    weight = module.weight.detach()
    if weight.shape == snapshot.weight.shape:
        return None  # nothing removed from its inputs
    kept = matched_columns(snapshot.weight.to(weight.device), weight)
    if kept is None:
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}'s columns are not a subset of its dense columns (a stage "
            "changed them, not only removed some); put reconstruct right after the stage that removes units"
        )
    width = snapshot.weight.shape[1]
    before = output_error(snapshot.weight, embed_columns(weight, kept, width), snapshot.gram, relative=True)
    refit = refit_least_squares(snapshot.weight, snapshot.gram, kept, damping=damping, toward_kept=toward == "kept")
    with torch.no_grad():
        module.weight.copy_(refit.weight.to(device=weight.device, dtype=weight.dtype))
    after = output_error(snapshot.weight, embed_columns(module.weight, kept, width), snapshot.gram, relative=True)
    return {
        "kept": int(kept.numel()),
        "of": int(width),
        "error_before": before,
        "error_after": after,
        "damping": refit.damping,
        "method": refit.info.method,
    }


@register_stage(
    "reconstruct",
    args=ReconstructArgs,
    scope="layer",
    needs_calibration=lambda _args: True,
    paper="least-squares reconstruction of the kept inputs (as in SlimGPT / ZipLM / FLAP's refits)",
    layer_grams=lambda args: frozenset(args.roles),
)
def reconstruct(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: dict) -> None:
    """Refit down_proj / o_proj from the kept inputs so the layer's output matches the dense layer's."""
    if "dense_consumers" not in stats:
        raise SlimkitError("reconstruct runs inside sequential, after the stage that removes units")
    # One report per block, updated layer by layer (the block cache lives as long as the block).
    if "reconstruct:report" not in ctx.block_cache:
        ctx.block_cache["reconstruct:report"] = ctx.report_stage("reconstruct", {"roles": {}, "layers": {}})
    entry = ctx.stage_report[ctx.block_cache["reconstruct:report"]]
    for role in args.roles:
        result = _refit_role(layer, role, stats, args.damping, args.toward)
        if result is not None:
            entry["layers"].setdefault(role, {})[str(layer.index)] = result
    for role, per_layer in entry["layers"].items():
        entry["roles"][role] = {
            "layers": len(per_layer),
            "mean_error_before": sum(r["error_before"] for r in per_layer.values()) / len(per_layer),
            "mean_error_after": sum(r["error_after"] for r in per_layer.values()) / len(per_layer),
        }
