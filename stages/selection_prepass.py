"""The allocation pre-pass of the selection stages (``prune_layer``, ``obs_prune_layer``) with ``allocation: global``
or ``search``: :class:`UnitScores`, their part of a layer-wise block's pre-pass
(:class:`~slimkit.engine.allocation_prepass.PrePass`), and :func:`check_reachable`, the refusal of a target no
allocation of their units reaches. The method note is docs/methods/allocation.md; the shared dense pass is
:mod:`slimkit.engine.allocation_prepass`.
"""

from __future__ import annotations

import time

import torch

from slimkit.engine.capabilities import ReadsLayerStatistics
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.primitives.allocate import (
    GlobalSettings,
    SearchSettings,
    UnitCosts,
    dense_log_probs,
    global_ranking,
    masked_units,
    mean_kl,
    search_levels,
    total_removed,
    unit_costs,
)
from slimkit.primitives.allocate.refit_error import allocate_by_error, prefix_refit_errors
from slimkit.primitives.arch import LayerView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.importance.compose import score_groups
from slimkit.primitives.importance.obs_saliency import OBS_CONSUMERS, consumer_inputs
from slimkit.primitives.select import eligible_layers
from slimkit.primitives.select.plan import SelectionRules, TargetOutOfReach, check_shapes, keep_indices
from slimkit.recipes.stage_args import offered
from slimkit.stages.allocation_results import AllocatedState, LayerAllocation
from slimkit.stages.selection import SelectionArgs, nearest_ratios, out_of_reach


def _allocatable(ctx: Context, args: SelectionArgs) -> tuple[list[Group], list[UnitCosts], SelectionRules]:
    """The stage's groups in its eligible layers, their costs under the rules and alignment, and the rules."""
    target = ctx.recipe.target
    settings = args.allocation_settings()
    rules = args.rules_for(target)
    layers = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
    groups = [g for layer in layers for kind in args.groups for g in build_groups(ctx.model, kind, [layer])]
    check_shapes(groups, rules)
    max_fraction = settings.max_fraction if isinstance(settings, GlobalSettings) else 1.0
    return groups, unit_costs(ctx.model, groups, rules, target.part, max_fraction), rules


def _method(args: SelectionArgs) -> str:
    return "global" if isinstance(args.allocation_settings(), GlobalSettings) else "search"


def check_reachable(
    ctx: Context, stage: str, args: SelectionArgs, costs: list[UnitCosts] | None = None
) -> tuple[int, int]:
    """Refuse, before any scoring, a target the stage's units cannot reach however they are allocated: every group
    at its fewest allowed units (alignment, ``min_keep``, ``max_fraction``) removes less than what is left of it.
    Returns what the stage is to remove and the tolerance, in parameters of the target's part."""
    target = ctx.recipe.target
    costs = costs if costs is not None else _allocatable(ctx, args)[1]
    dense = ctx.params_before[target.part]
    wanted, tolerance = ctx.params_to_remove(), round(target.tolerance * dense)
    most = total_removed(costs, [min(c.allowed()) for c in costs])
    if wanted > most + tolerance:
        nearest = nearest_ratios(target, dense, wanted, TargetOutOfReach(wanted, tolerance, most, None))
        raise SlimkitError(out_of_reach(f"{stage} (allocation {_method(args)})", args, target, nearest))
    return wanted, tolerance


class UnitScores:
    """The pre-pass of a ``prune_layer`` / ``obs_prune_layer`` stage with a global or searched allocation: its units
    scored once per layer by the stage's own scorer on the shared dense pass, then kept counts per eligible layer and
    kind landing on what is left of the target (refused before any scoring when no plan can reach it), written into
    the stage's ``state``."""

    def __init__(self, ctx: Context, stage: str, args: SelectionArgs, state: AllocatedState) -> None:
        self.stage, self.args, self.state = stage, args, state
        self.settings = args.allocation_settings()
        self.groups, self.costs, self.rules = _allocatable(ctx, args)
        check_reachable(ctx, stage, args, self.costs)
        total = len(ctx.calibration_batches())
        holdout = self.settings.holdout_batches if isinstance(self.settings, SearchSettings) else 0
        if holdout >= total:
            raise SlimkitError(
                f"{stage}: allocation.search.holdout_batches {holdout} leaves none of the {total} calibration "
                "batches to score on; lower it or raise calibration.samples"
                if holdout
                else f"{stage}: allocation: global by refit_error measures on calibration batches, and the run has none"
            )
        self.scoring_batches: int | None = total - holdout
        self.by_error = isinstance(self.settings, GlobalSettings) and self.settings.by == "refit_error"
        consumers = {OBS_CONSUMERS[kind] for kind in args.groups} if self.by_error else set()
        self.roles = frozenset(offered(args, ReadsLayerStatistics).layer_grams()) | consumers
        self.by_layer: dict[int, list[int]] = {}
        for position, group in enumerate(self.groups):
            self.by_layer.setdefault(layer_of(group), []).append(position)
        self.last = max(self.by_layer)
        self.scores: list = [None] * len(self.groups)
        self.errors: list = [None] * len(self.groups)
        self.scorer, self.scorer_args = args.allocation_scorer()
        self.ctx = ctx

    def visit(self, layer: LayerView, stats: LayerStats) -> None:
        if layer.index not in self.by_layer:
            return
        positions = self.by_layer[layer.index]
        members = [self.groups[i] for i in positions]
        found = score_groups(
            self.scorer, members, self.ctx.model, [stats], generator=self.ctx.generator, **self.scorer_args
        )
        for i, value in zip(positions, found, strict=True):
            self.scores[i] = value.detach().float().cpu()
            if self.by_error:
                self.errors[i] = _refit_errors(self.groups[i], self.ctx.model, stats, self.scores[i])

    def decide(self, ctx: Context, pass_seconds: float) -> None:
        self.state.allocation = self._allocation(ctx, pass_seconds)

    def _allocation(self, ctx: Context, passed: float) -> LayerAllocation:
        stage, args, settings = self.stage, self.args, self.settings
        groups, costs, rules, scores = self.groups, self.costs, self.rules, self.scores
        deciding = time.perf_counter()
        target = ctx.recipe.target
        wanted, tolerance = check_reachable(ctx, stage, args, costs)  # after the block's earlier stages decided
        dense = ctx.params_before[target.part]
        batches = ctx.calibration_batches()
        held = batches[self.scoring_batches :]
        report: dict = {"method": _method(args)}
        try:
            if self.by_error:
                kept = allocate_by_error(self.errors, costs, wanted, tolerance)
                report["by"] = "refit_error"
            elif isinstance(settings, GlobalSettings):
                kept = global_ranking(scores, costs, wanted, tolerance)
            elif isinstance(settings, SearchSettings):
                kept, report["search"] = _search(ctx, settings, groups, scores, costs, held, rules, wanted, tolerance)
            else:  # uniform allocations make no pre-pass
                raise AssertionError(f"{stage}: no allocation to decide")
        except TargetOutOfReach as miss:
            nearest = nearest_ratios(target, dense, wanted, miss)
            raise SlimkitError(
                out_of_reach(f"{stage} (allocation {report['method']})", args, target, nearest)
            ) from None
        allocation = LayerAllocation({}, {})
        for group, count in zip(groups, kept, strict=True):
            allocation.kept.setdefault(layer_of(group), {})[group.kind] = count
            allocation.sizes.setdefault(layer_of(group), {})[group.kind] = group.size
        removed = total_removed(costs, kept)
        report |= {
            "wanted": wanted,
            "removed": removed,
            "achieved_share": removed / dense,
            "kept": {str(layer): dict(counts) for layer, counts in allocation.kept.items()},
            "layer_share": _layer_shares(costs, kept),
            "mean_unit_fraction": {
                kind: sum(1 - k / c.size for c, k in zip(costs, kept, strict=True) if c.kind == kind)
                / sum(1 for c in costs if c.kind == kind)
                for kind in args.groups
            },
            "align": {kind: target.align[kind] for kind in target.multiples(list(args.groups))},
            "score_seconds": passed,  # the block's shared dense pass
            "seconds": round(passed + time.perf_counter() - deciding, 3),
        }
        allocation.report = report
        return allocation


def layer_of(group: Group) -> int:
    """The layer of a group of a layer-wise stage (every kind it allocates lives in one layer)."""
    if group.layer is None:
        raise SlimkitError(f"{group.kind} spans every layer; a layer-wise allocation cannot share it among layers")
    return group.layer


def _refit_errors(group: Group, model: torch.nn.Module, stats: LayerStats, scores: torch.Tensor) -> torch.Tensor:
    """The group's relative refit-error curve on the dense pass's consumer Gram, units kept in score order."""
    weight, gram, columns = consumer_inputs(group, model, stats, "allocation by refit_error")
    order = torch.argsort(scores.double(), descending=True, stable=True)
    return prefix_refit_errors(weight, gram, columns, order)


def _layer_shares(costs: list[UnitCosts], kept: list[int]) -> dict[str, float]:
    """Per layer, the fraction of its allocatable parameters (the stage's kinds) removed."""
    removable: dict[str, int] = {}
    removed: dict[str, int] = {}
    for cost, count in zip(costs, kept, strict=True):
        key = str(cost.layer)
        removable[key] = removable.get(key, 0) + cost.size * cost.unit_params
        removed[key] = removed.get(key, 0) + cost.removed(count)
    return {key: round(removed[key] / removable[key], 4) if removable[key] else 0.0 for key in removable}


def _search(
    ctx: Context,
    settings: SearchSettings,
    groups: list[Group],
    scores: list,
    costs: list[UnitCosts],
    held: list[torch.Tensor],
    rules: SelectionRules,
    wanted: int,
    tolerance: int,
) -> tuple[list[int], dict]:
    """The searched kept counts and the search's report (trace, fitness at the start and at the end)."""
    ladder = settings.ladder()
    counts = [[cost.kept(cost.size * (1.0 - level)) for level in ladder] for cost in costs]
    removed = [[cost.removed(k) for k in row] for cost, row in zip(costs, counts, strict=True)]
    keeps = [
        [keep_indices(group, score, k, rules) for k in row]
        for group, score, row in zip(groups, scores, counts, strict=True)
    ]
    reference = dense_log_probs(ctx.model, held)

    def fitness(levels: list[int]) -> float:
        kept = [keeps[i][level] for i, level in enumerate(levels)]
        with masked_units(ctx.model, groups, kept):
            return mean_kl(ctx.model, held, reference)

    result = search_levels(
        removed, wanted, tolerance, fitness, settings.budget_s, settings.max_evals, settings.seed, settings.offspring
    )
    kept = [counts[i][level] for i, level in enumerate(result.levels)]
    report = {
        "levels": list(ladder),
        "level_of": {f"{g.layer}.{g.kind}": ladder[level] for g, level in zip(groups, result.levels, strict=True)},
        "start_kl": result.start_fitness,
        "kl": result.fitness,
        "holdout_tokens": sum(batch.numel() for batch in held),
        "trace": result.trace.as_dict(),
    }
    return kept, report


__all__ = ["UnitScores", "check_reachable"]
