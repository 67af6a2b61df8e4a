"""Pruning stages.

* ``prune`` (model scope): score coupling groups of the chosen kinds in the eligible layers, choose kept units by the
  selection rules so the recipe target is met, check the whole plan, then remove the units.
* ``prune_layer`` (layer scope, usable inside ``sequential``): the same for one layer at a time, with that layer's
  statistics (uniform selection unless ``allocation`` is ``{global: ...}`` or ``{search: ...}``).

Any registered scorer or composition can score any group kind it supports. The removal fraction follows the
recipe's one budget: ``ratio_rule: solve`` removes what is left of the target (minus what the block's other stages
plan), ``ratio_rule: layer`` is LoRAP's layer ratio, an explicit ``ratio`` is checked when the run ends.

Method note: docs/methods/selection.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from slimkit.engine.capabilities import PlansMemory, ReadsLayerStatistics, default_memory
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import PrePass, StageResult
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, GRADIENT_ADVICE, MemoryInputs, forward_memory
from slimkit.primitives.allocate.allocation_settings import GlobalSettings, SearchSettings
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import input_norm_hooks
from slimkit.primitives.device.memory_model import StageMemory, gradient_sum_bytes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import param_parts
from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.importance import ScorerSpec
from slimkit.primitives.importance.compose import score_groups, spec_names, spec_smooths
from slimkit.primitives.importance.obs_saliency import OBS_CONSUMERS
from slimkit.primitives.projection.adapters import basis_change_params
from slimkit.primitives.select import eligible_layers
from slimkit.primitives.select.plan import (
    Fraction,
    SelectionRules,
    TargetOutOfReach,
    check_shapes,
    kept_counts,
    plan,
    removed_params,
    solve_fraction,
    solve_target,
)
from slimkit.primitives.surgery.units import RemovableKind, remove_units
from slimkit.recipes.stage_args import ChangesProjections
from slimkit.stages.allocation_results import LayerAllocation, allocated_fraction
from slimkit.stages.layer_rule import layer_rule_ratio
from slimkit.stages.scoring import (
    ScoringArgs,
    evaluations,
    largest_scored,
    roles_of,
    scored_params,
    scoring_bytes,
    with_scoring,
)
from slimkit.stages.selection import SelectionArgs, nearest_ratios, out_of_reach
from slimkit.stages.selection_prepass import UnitScores

GroupKind = RemovableKind
EXCLUSIVE_KINDS = (("attention_head", "kv_group"), ("linear_head", "linear_kv_group"), ("mamba_head", "mamba_channel"))
"""Kinds whose units share parameters: one stage prunes one of each pair."""


class PruneArgs(SelectionArgs[GroupKind], ScoringArgs, ChangesProjections, PlansMemory):
    selection: Literal["uniform", "global"] = "uniform"
    """uniform: every group loses the same fraction; global: one score threshold per kind across layers."""
    protect_lowest: float = Field(0.0, ge=0.0, lt=1.0)
    """Retain the least important fraction of units (LoRAP Eq. 11: 0.01)."""

    @model_validator(mode="after")
    def _compatible(self) -> PruneArgs:
        for first, second in EXCLUSIVE_KINDS:
            if first in self.groups and second in self.groups:
                raise ValueError(f"groups: choose {first} or {second}, not both")
        self.check_kinds(self.groups)
        return self

    def rules(self) -> SelectionRules:
        round_to: dict[str, int] = {kind: multiple for kind, multiple in self.round_to.items()}
        return SelectionRules(self.selection, round_to, self.min_keep, self.protect_lowest)

    def needs_calibration(self) -> bool:
        return bool(self.needs())

    def touches(self) -> frozenset[LinearRole]:
        return roles_of(self.groups)

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """A gradient scorer: the float32 gradient sums of the scored weights (on the host with ``stats_device:
        cpu``), one gradient before it is folded in, the backward's activations; else one forward's activations.
        Then the scoring of the largest scored weight (float32 copies, ``scoring_bytes``) where it is larger than
        what it follows."""
        if not self.needs_gradients():  # one forward's activations (a data scorer's), freed before the scoring
            scoring = scoring_bytes(inputs.shape, self.groups)
            return with_scoring(forward_memory(stage, inputs), scoring, ["activations"])
        shape = inputs.shape
        params = scored_params(shape, self.groups, max(shape.layers - self.skip_first - self.skip_last, 0))
        memory = StageMemory(stage, advice=GRADIENT_ADVICE)
        squares = "taylor" in spec_names(self.scorer_spec()) and self.order != "first"
        sums = gradient_sum_bytes(params, squares)
        if self.stats_device == "cpu":
            memory.host_parts["gradient sums"] = sums
            memory.advice = ACTIVATION_ADVICE
        else:
            memory.parts["gradient sums"] = sums
        # the largest scored weight's gradient, before it is summed
        memory.parts["one gradient"] = largest_scored(shape, self.groups) * inputs.dtype_bytes
        memory = self.add_backward_activations(memory, inputs)
        return with_scoring(memory, scoring_bytes(shape, self.groups), ["activations", "one gradient"])


class PruneLayerArgs(PruneArgs, ReadsLayerStatistics):
    allocates: ClassVar[bool] = True

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        return default_memory(self, stage, inputs)  # one layer at a time: the default, not prune's whole model

    @model_validator(mode="after")
    def _layer_scope(self) -> PruneLayerArgs:
        if self.selection != "uniform":
            raise ValueError("selection: prune_layer works one layer at a time; use uniform (or the prune stage)")
        if "gradients" in self.needs():
            raise ValueError(
                f"scorer: {self.scorer_name()} needs whole-model gradients, and prune_layer sees one layer's "
                "activations; use the prune stage"
            )
        if "hidden_feature" in self.groups:
            raise ValueError("groups: hidden_feature spans every layer; use the prune stage")
        if self.allocation_settings() != "uniform" and spec_smooths(self.scorer_spec()):
            raise ValueError(
                f"allocation: the allocation pre-pass scores each layer once, and scorer {self.scorer_name()} "
                "smooths over batches; use a plain scorer or allocation: uniform"
            )
        return self

    def allocation_scorer(self) -> tuple[ScorerSpec, dict]:
        """The scorer (and its arguments) the allocation pre-pass ranks this stage's units by: the stage's own."""
        return self.scorer_spec(), self.scorer_args()

    def needs_calibration(self) -> bool:
        """The scorer's data, and calibration batches for an allocation that measures on them whatever the scorer
        reads: ``global`` by ``refit_error`` (the consumers' dense Grams) and ``search`` (its held-out KL)."""
        chosen = self.allocation_settings()
        measures = isinstance(chosen, SearchSettings) or (
            isinstance(chosen, GlobalSettings) and chosen.by == "refit_error"
        )
        return super().needs_calibration() or measures

    def plan(self, ctx: Context) -> int:
        return planned_layer_removal(ctx, self)

    def layer_grams(self) -> frozenset[LinearRole]:
        """Consumer Grams (down for channels, o for heads) for a scorer that reads them (``obs``)."""
        if "dense_consumers" not in self.needs():
            return frozenset()
        return frozenset(OBS_CONSUMERS[k] for k in self.groups if k in OBS_CONSUMERS)


def solve_on_target(
    ctx: Context, name: str, args: SelectionArgs[Any], groups: list[Group], scores: list[torch.Tensor]
) -> Fraction:
    """The fraction (shared, or per kind where a coarse kind jumps over the target) whose plan removes what is
    left of the target within its tolerance. A strict target no plan of these units can meet is refused in one
    line naming the stage, the nearest achievable ratios and what to change; a non-strict one keeps the nearest
    shared fraction (the run is flagged when it ends)."""
    target = ctx.recipe.target
    dense = ctx.params_before[target.part]
    wanted = ctx.params_to_remove()
    rules = args.rules_for(target)
    check_shapes(groups, rules)
    try:
        return solve_target(ctx.model, groups, scores, rules, target.part, wanted, round(target.tolerance * dense))
    except TargetOutOfReach as miss:
        if target.strict:
            raise SlimkitError(out_of_reach(name, args, target, nearest_ratios(target, dense, wanted, miss))) from None
    except SlimkitError as error:  # more than the groups hold
        raise SlimkitError(f"{name}: {error}{_added_before(ctx, dense)}") from None
    try:
        return solve_fraction(ctx.model, groups, scores, rules, target.part, wanted)
    except SlimkitError as error:
        raise SlimkitError(f"{name}: {error}{_added_before(ctx, dense)}") from None


def _added_before(ctx: Context, dense: int) -> str:
    """What the stages before this one added to the target's part (a projection's maps, an untied head), as the
    tail of a refusal; empty when they added nothing."""
    part = ctx.recipe.target.part
    start = ctx.block_params().get(part, dense)
    if start <= dense:
        return ""
    return f"; the stages before it added {start - dense:,} parameters of {part} to the dense model's {dense:,}"


def fraction_before_scores(ctx: Context, name: str, args: PruneArgs, groups: list[Group]) -> Fraction | None:
    """The fraction known before any score: the explicit ratio, LoRAP's layer ratio, or, for uniform selection
    (whose plan depends only on the shapes), solved on the target; None for global selection (solved on the
    scores)."""
    if args.ratio is not None:
        return args.ratio
    if args.ratio_rule == "layer":
        return layer_rule_ratio(ctx)
    if args.rules().mode == "uniform":
        return solve_on_target(ctx, name, args, groups, [torch.zeros(g.size) for g in groups])
    return None


def _score_and_prune(
    ctx: Context, args: PruneArgs, groups: list[Group], stats: Iterable[Mapping[str, Any]], fraction: Fraction | None
) -> Fraction:
    scores = score_groups(args.scorer_spec(), groups, ctx.model, stats, generator=ctx.generator, **args.scorer_args())
    rules = args.rules_for(ctx.recipe.target)
    check_shapes(groups, rules)
    if fraction is None:
        fraction = solve_on_target(ctx, "prune", args, groups, scores)
    keeps = plan(groups, scores, fraction, rules)  # validated before any weight changes
    for group, keep in zip(groups, keeps, strict=True):
        remove_units(ctx.model, group, keep)
    return fraction


def fraction_entry(
    fraction: Fraction | None, args: PruneArgs, allocation: LayerAllocation | None = None
) -> dict[str, Any]:
    """A pruning stage's report entry. ``fraction_mode``: ``shared`` (one unit fraction for every kind),
    ``per_kind`` (``unit_fraction`` by kind: a coarse kind jumped over the target, so it keeps the nearest step and
    the other kinds land the total) or ``allocated`` (each layer its own, decided by the allocation pre-pass:
    ``allocation`` holds the per-layer shares, and ``unit_fraction`` the mean fraction of each kind over the
    layers)."""
    report = allocation.report if allocation is not None else None
    entry: dict[str, Any] = {
        "unit_fraction": report["mean_unit_fraction"] if report else fraction,
        "fraction_mode": "allocated" if report else "per_kind" if isinstance(fraction, dict) else "shared",
        "groups": list(args.groups),
        "scorer": args.scorer_name(),
    }
    if report:
        entry["allocation"] = report
    return entry


@register_stage(
    "prune",
    args=PruneArgs,
    paper="LLM-Pruner (Ma et al. 2023) Eqs. 3-5 with scorer taylor; Wanda-style channels; LoRAP Eq. 11",
)
class Prune:
    """Score coupling groups on the model and remove the least important units to meet the target."""

    def run_model(self, ctx: Context, args: PruneArgs) -> StageResult:
        if "dense_consumers" in args.needs():
            raise SlimkitError(
                f"prune: scorer {args.scorer_name()} needs per-layer Grams; use prune_layer (in sequential)"
            )
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
        fraction = fraction_before_scores(ctx, "prune", args, groups)  # a target out of reach is refused here
        stats = evaluations(ctx.model, args.scorer_spec(), ctx.calibration_batches(), groups, args)  # one at a time
        fraction = _score_and_prune(ctx, args, groups, stats, fraction)
        return StageResult({**fraction_entry(fraction, args), "layers": layers})


def _layer_groups(ctx: Context, args: SelectionArgs[Any]) -> list[Group]:
    eligible = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
    return [g for kind in args.groups for g in build_groups(ctx.model, kind, eligible)]


def _removed_at(ctx: Context, args: SelectionArgs[Any], groups: list[Group], fraction: Fraction) -> int:
    counts = kept_counts(groups, [torch.zeros(g.size) for g in groups], fraction, args.rules_for(ctx.recipe.target))
    return removed_params(ctx.model, groups, counts, ctx.recipe.target.part, param_parts(ctx.model))


def layer_fraction(ctx: Context, args: SelectionArgs[Any], name: str = "prune_layer") -> Fraction:
    """The unit fraction of every eligible layer: the explicit ratio, LoRAP's layer ratio, or solved so
    the block's removals meet what is left of the target (on the shapes when the block started); ``name``:
    the stage a refusal names."""
    if args.ratio is not None:
        return args.ratio
    if args.ratio_rule == "layer":
        return layer_rule_ratio(ctx)
    groups = _layer_groups(ctx, args)
    return solve_on_target(ctx, name, args, groups, [torch.zeros(g.size) for g in groups])


def planned_layer_removal(ctx: Context, args: SelectionArgs[Any]) -> int:
    """Parameters of the target's part prune_layer will remove with an explicit or layer-rule fraction."""
    return _removed_at(ctx, args, _layer_groups(ctx, args), layer_fraction(ctx, args))


def _per_batch_norms(ctx: Context, layer: LayerView, stats: LayerStats) -> list[dict]:
    """One ``input_norms`` dict per calibration batch (for smoothing scorers), re-running the layer."""
    inputs = stats.inputs()
    modules = ctx.view.linears([layer])
    result = []
    for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
        with input_norm_hooks(modules) as accumulators, torch.no_grad():
            layer.module(hidden, **kwargs)
        result.append({"input_norms": {path: acc.norms() for path, acc in accumulators.items()}})
    return result


@dataclass
class PruneLayerState:
    """A ``prune_layer`` stage across its block: the pre-pass's allocation, else the uniform fraction solved at the
    first eligible layer (on the block's shapes)."""

    ctx: Context
    args: PruneLayerArgs
    allocation: LayerAllocation | None = None
    fraction: Fraction | None = None


@register_stage(
    "prune_layer",
    args=PruneLayerArgs,
    paper="LoRAP §3.3 (Eqs. 8-11): activation-scored MLP channels, layer by layer",
)
class PruneLayer:
    """Score and remove units of one layer (inside `sequential`, with that layer's statistics)."""

    def start(self, ctx: Context, args: PruneLayerArgs) -> PruneLayerState:
        return PruneLayerState(ctx, args)

    def allocation_prepass(self, state: PruneLayerState) -> PrePass | None:
        """With ``allocation: global`` or ``search``: the units scored on the block's dense pass, then kept counts
        per layer (:class:`~slimkit.stages.selection_prepass.UnitScores`)."""
        if state.args.allocation_settings() == "uniform":
            return None
        return UnitScores(state.ctx, "prune_layer", state.args, state)

    def run_layer(self, state: PruneLayerState, layer: LayerView, stats: LayerStats) -> None:
        ctx, args = state.ctx, state.args
        eligible = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
        if layer.index not in eligible:
            return
        # a layer whose sub-block of a kind was removed (remove_blocks) has no group of that kind
        groups = [g for kind in args.groups for g in build_groups(ctx.model, kind, [layer.index])]
        if not groups:
            return
        fraction = allocated_fraction("prune_layer", args, state.allocation, layer.index)  # the pre-pass's share
        if fraction is None:  # uniform: solved once per block, at the first eligible layer (on the block's shapes)
            if state.fraction is None:
                state.fraction = layer_fraction(ctx, args)
            fraction = state.fraction
        evaluations_: list[Mapping[str, Any]] = [stats]
        if spec_smooths(args.scorer_spec()):
            evaluations_ = list(_per_batch_norms(ctx, layer, stats))
        _score_and_prune(ctx, args, groups, evaluations_, fraction)

    def finish(self, state: PruneLayerState) -> StageResult:
        return StageResult(fraction_entry(state.fraction, state.args, state.allocation))
