"""Built-in stages (importing this module registers them).

The foundation ships one stage, ``mlp_channels``; the pruning-core issue adds heads, KV groups,
hidden features and more scorers under the same registry.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from slimkit.primitives.arch import LayerView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import mlp_channel_group
from slimkit.primitives.importance import NEEDS_CALIBRATION, SCORERS
from slimkit.primitives.select import keep_count, keep_top
from slimkit.primitives.surgery import prune_mlp_channels
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict, Target

# Which entry of params_by_part a target is a ratio of.
TARGET_PART = {"model": "total", "layers": "layers", "mlp": "mlp", "attention": "attention"}


class MLPChannelArgs(Strict):
    scorer: Literal["activation", "magnitude", "random"] = "activation"
    aggregation: Literal["l1", "l2", "linf", "mean"] = "l2"
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of each layer's MLP channels to remove; None derives it from the recipe target."""
    round_to: int = Field(1, ge=1)
    """Keep a multiple of this many channels per layer."""


def mlp_channel_ratio(target: Target, params_before: dict[str, int]) -> float:
    """Uniform per-layer fraction of MLP channels that removes ``target.ratio`` of ``target.of``.

    MLP parameters are (almost) all per-channel, so removing a fraction r of every layer's channels
    removes r x the MLP's parameters: r = ratio x params(of) / params(mlp).
    """
    if target.of == "attention":
        raise SlimkitError(
            "stage mlp_channels cannot meet a target of 'attention'; use target.of: mlp, layers or model"
        )
    ratio = target.ratio * params_before[TARGET_PART[target.of]] / params_before["mlp"]
    if ratio >= 1.0:
        most = params_before["mlp"] / params_before[TARGET_PART[target.of]]
        raise SlimkitError(
            f"target.ratio={target.ratio} of {target.of} would remove {ratio:.0%} of the MLP channels; "
            f"MLP channel pruning alone can remove less than {most:.0%}"
            f" of the {target.of}"
        )
    return ratio


@register_stage(
    "mlp_channels",
    args=MLPChannelArgs,
    scope="layer",
    needs_calibration=lambda args: args.scorer in NEEDS_CALIBRATION,
)
def mlp_channels(ctx: Context, args: MLPChannelArgs, layer: LayerView, stats: dict) -> None:
    """Score MLP channels (gate/up rows + down column) and remove the lowest, uniformly per layer."""
    ratio = args.ratio if args.ratio is not None else mlp_channel_ratio(ctx.recipe.target, ctx.params_before)
    group = mlp_channel_group(layer)
    scores = SCORERS[args.scorer](group, layer, stats, aggregation=args.aggregation, generator=ctx.generator)
    if not torch.isfinite(scores).all():
        raise RuntimeError(f"layer {layer.index}: non-finite {args.scorer} scores")
    keep = keep_top(scores, keep_count(group.size, ratio, args.round_to))
    prune_mlp_channels(layer, keep)
    ctx.stage_report.setdefault("mlp_channels", {})["channel_ratio"] = ratio
