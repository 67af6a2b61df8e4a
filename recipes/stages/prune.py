"""Pruning stages.

* ``prune`` (model scope): score coupling groups of the chosen kinds in the eligible layers with
  statistics of the dense model (input norms from one calibration pass, or calibration-loss
  gradients for ``taylor``), choose kept units by the selection rules so the recipe target is met,
  check the whole plan, then remove the units.
* ``prune_layer`` (layer scope, usable inside ``sequential``): the same for one layer at a time,
  with that layer's statistics (uniform selection; no gradients, no hidden features).

The removal fraction is solved so the recipe target is met (``ratio_rule: solve``), or set to
LoRAP's layer ratio Ratio_l = Param_total x Ratio_s / (layers x Param_layer) (Appendix C.1,
``ratio_rule: layer``) so that every layer's sub-layers lose the same fraction.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from slimkit.primitives.arch import LayerView
from slimkit.primitives.calibration import input_norm_hooks
from slimkit.primitives.calibration.gradients import accumulate_gradients
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.importance import NEEDS, score_group
from slimkit.primitives.lowrank import layer_ratio
from slimkit.primitives.projection.adapters import basis_change_params
from slimkit.primitives.select import eligible_layers
from slimkit.primitives.select.plan import SelectionRules, check_shapes, plan, solve_fraction
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict, Target

# Which entry of params_by_part a target is a ratio of.
TARGET_PART = {"model": "total", "layers": "layers", "mlp": "mlp", "attention": "attention"}
GroupKind = Literal["mlp_channel", "attention_head", "kv_group", "hidden_feature"]


class PruneArgs(Strict):
    groups: list[GroupKind] = Field(default_factory=lambda: ["mlp_channel"], min_length=1)
    scorer: Literal["activation", "magnitude", "random", "taylor"] = "activation"
    aggregation: Literal["l1", "l2", "linf", "mean"] = "l2"
    order: Literal["first", "second", "mix"] = "first"
    """Taylor term (taylor only)."""
    level: Literal["element", "vector"] = "vector"
    """Taylor element-wise or vector-wise importance (taylor only)."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of units removed from every group; None solves it from the recipe target."""
    selection: Literal["uniform", "global"] = "uniform"
    skip_first: int = Field(0, ge=0)
    skip_last: int = Field(0, ge=0)
    round_to: dict[GroupKind, int] = Field(default_factory=dict)
    min_keep: int = Field(1, ge=1)
    protect_lowest: float = Field(0.0, ge=0.0, lt=1.0)
    """Retain the least important fraction of units (LoRAP Eq. 11)."""
    ratio_rule: Literal["solve", "layer"] = "solve"
    """How the fraction follows from the target when ``ratio`` is not given (see module docstring)."""

    @model_validator(mode="after")
    def _compatible(self) -> PruneArgs:
        if "attention_head" in self.groups and "kv_group" in self.groups:
            raise ValueError("groups: choose attention_head or kv_group, not both")
        if any(v < 1 for v in self.round_to.values()):
            raise ValueError("round_to: multiples must be >= 1")
        return self

    def rules(self) -> SelectionRules:
        return SelectionRules(self.selection, dict(self.round_to), self.min_keep, self.protect_lowest)

    def scorer_args(self) -> dict:
        return {"aggregation": self.aggregation, "order": self.order, "level": self.level}


class PruneLayerArgs(PruneArgs):
    @model_validator(mode="after")
    def _layer_scope(self) -> PruneLayerArgs:
        if self.selection != "uniform":
            raise ValueError("selection: prune_layer works one layer at a time; use uniform (or the prune stage)")
        if self.scorer == "taylor":
            raise ValueError("scorer: taylor needs whole-model gradients; use the prune stage")
        if "hidden_feature" in self.groups:
            raise ValueError("groups: hidden_feature spans every layer; use the prune stage")
        return self


def _needs(args: PruneArgs) -> set[str]:
    return set(NEEDS.get(args.scorer, ()))


def _wanted(ctx: Context, target: Target, dense_shapes: bool = False) -> tuple[str, int]:
    """Parameters of the target's part to remove now so that the recipe's result meets its target.

    The target is a fraction of the dense model, so what earlier stages added (SP3's residual
    matrices) or removed counts: remove ``now - (1 - ratio) x dense``. ``dense_shapes``: the plain
    ``ratio x dense`` (a layer-scope fraction solved once on the still-dense shapes).
    """
    part = TARGET_PART[target.of]
    if dense_shapes:
        return part, round(target.ratio * ctx.params_before[part])
    now = params_by_part(ctx.model)[part]
    return part, max(0, now - round((1.0 - target.ratio) * ctx.params_before[part]))


def lorap_layer_ratio(ctx: Context) -> float:
    """LoRAP Appendix C.1: the per-layer ratio that removes the target ratio of the whole model.

    Param_layer counts one layer's compressible parameters (attention and MLP projections) of the
    dense model, averaged over the layers.
    """
    target = ctx.recipe.target
    if target.of != "model":
        raise SlimkitError(f"ratio_rule: layer needs target.of: model (got {target.of})")
    layers = ctx.view.num_layers
    layer_params = (ctx.params_before["attention"] + ctx.params_before["mlp"]) // layers
    return layer_ratio(ctx.params_before["total"], target.ratio, layers, layer_params)


def _dense_input_norms(ctx: Context) -> dict[str, torch.Tensor]:
    view = ctx.view
    modules = {}
    for layer in view.layers:
        for role in layer.roles:
            modules[view.path_of(layer.linear(role))] = layer.linear(role)
    with input_norm_hooks(modules) as accumulators, torch.no_grad():
        for batch in ctx.calibration_batches():
            ctx.model(batch, use_cache=False)
    return {path: acc.norms() for path, acc in accumulators.items()}


def _score_and_prune(ctx: Context, args: PruneArgs, groups: list[Group], stats: dict, fraction: float | None) -> float:
    scores = [
        score_group(args.scorer, g, ctx.model, stats, generator=ctx.generator, **args.scorer_args()) for g in groups
    ]
    rules = args.rules()
    check_shapes(groups, rules)
    if fraction is None and args.ratio_rule == "layer":
        fraction = lorap_layer_ratio(ctx)
    if fraction is None:
        part, wanted = _wanted(ctx, ctx.recipe.target)
        fraction = solve_fraction(ctx.model, groups, scores, rules, part, wanted)
    keeps = plan(groups, scores, fraction, rules)  # validated before any weight changes
    for group, keep in zip(groups, keeps, strict=True):
        remove_units(ctx.model, group, keep)
    return fraction


def _record(ctx: Context, name: str, fraction: float, args: PruneArgs, layers: list[int] | None = None) -> None:
    entry = ctx.stage_report.setdefault(name, {})
    entry.update({"unit_fraction": fraction, "groups": list(args.groups), "scorer": args.scorer})
    if layers is not None:
        entry["layers"] = layers


@register_stage("prune", args=PruneArgs, scope="model", needs_calibration=lambda a: bool(_needs(a)))
def prune(ctx: Context, args: PruneArgs) -> None:
    """Score coupling groups on the dense model and remove the least important units to meet the target."""
    view = ctx.view
    if "hidden_feature" in args.groups and basis_change_params(ctx.model):
        raise SlimkitError(
            "prune: groups: hidden_feature cannot prune a model with residual matrices (an earlier pca_project "
            "with several bases); prune heads or MLP channels, or slice the stream with pca_project's ratio"
        )
    layers = eligible_layers(view.num_layers, args.skip_first, args.skip_last)
    groups: list[Group] = []
    for kind in args.groups:
        groups += build_groups(ctx.model, kind, None if kind == "hidden_feature" else layers)
    stats: dict = {}
    if "input_norms" in _needs(args):
        stats["input_norms"] = _dense_input_norms(ctx)
    if "gradients" in _needs(args):
        stats["gradients"] = accumulate_gradients(ctx.model, ctx.calibration_batches())
    fraction = _score_and_prune(ctx, args, groups, stats, args.ratio)
    _record(ctx, "prune", fraction, args, layers)


@register_stage("prune_layer", args=PruneLayerArgs, scope="layer", needs_calibration=lambda a: bool(_needs(a)))
def prune_layer(ctx: Context, args: PruneLayerArgs, layer: LayerView, stats: dict) -> None:
    """Score and remove units of one layer (inside `sequential`, with that layer's statistics)."""
    eligible = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
    if layer.index not in eligible:
        return
    groups = [build_groups(ctx.model, kind, [layer.index])[0] for kind in args.groups]
    fraction = args.ratio
    if fraction is None:
        # Solved once, at the first eligible layer while the model is still dense, per group set.
        solved = ctx.stage_report.setdefault("prune_layer", {}).setdefault("fractions", {})
        key = "+".join(args.groups)
        if key not in solved:
            solved[key] = lorap_layer_ratio(ctx) if args.ratio_rule == "layer" else layer_fraction(ctx, args)
        fraction = solved[key]
    _score_and_prune(ctx, args, groups, stats, fraction)
    _record(ctx, "prune_layer", fraction, args)


def layer_fraction(ctx: Context, args: PruneLayerArgs) -> float:
    """The uniform unit fraction meeting the target, solved once on the still-dense model's shapes."""
    eligible = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
    groups = [g for kind in args.groups for g in build_groups(ctx.model, kind, eligible)]
    scores = [torch.zeros(g.size) for g in groups]
    check_shapes(groups, args.rules())
    part, wanted = _wanted(ctx, ctx.recipe.target, dense_shapes=True)
    return solve_fraction(ctx.model, groups, scores, args.rules(), part, wanted)
