"""``prune_experts`` and ``merge_experts`` (model scope): remove whole routed experts of a mixture-of-experts model.

One calibration pass collects every MoE layer's routing statistics; each layer keeps a set of experts chosen by the
``scorer`` (``frequency``, ``weight`` or ``naee``). ``prune_experts`` drops the rest; ``merge_experts`` merges each
dropped expert into its most similar kept one and refits the router. How many go: ``keep`` per layer, or solved from
the recipe's one target; ``allocation: uniform`` keeps the same count in every layer, ``global`` spreads the
removals over the layers. A layer always keeps its top-k experts.

Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel, ChecksReach, PlansMemory, PlansRemoval
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, MemoryInputs
from slimkit.primitives.arch.moe import MoEBlock, check_all_sparse, moe_blocks
from slimkit.primitives.calibration.routing import ExpertRouting, collect_routing
from slimkit.primitives.device.memory_model import FLOAT32, StageMemory, forward_activation_bytes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts.merge import assign_dropped, merged_weights, set_expert_weights
from slimkit.primitives.experts.reach import expert_reach
from slimkit.primitives.experts.routed import ExpertWeights
from slimkit.primitives.experts.scores import (
    ExpertScorer,
    allocate_removals,
    dropped_share_curve,
    keep_top,
    naee_search,
    router_scores,
)
from slimkit.primitives.experts.surgery import keep_experts
from slimkit.recipes.stage_args import BudgetMode, ReadsData, SharesTarget, StageArgs

ExpertAllocation = Literal["uniform", "global"]


class ExpertPruneArgs(StageArgs, SharesTarget, PlansRemoval, ReadsData, PlansMemory, ChecksModel, ChecksReach):
    scorer: ExpertScorer = "naee"
    """How a layer's kept experts are chosen: naee (least reconstruction loss of the routed output over candidate
    kept sets), frequency (the experts most tokens pick), weight (the largest mean top-k routing weight)."""
    keep: int | None = Field(None, ge=1)
    """Experts every MoE layer keeps; None: set by ratio, or solved from the recipe target."""
    ratio: float | None = Field(None, gt=0.0, lt=1.0, allow_inf_nan=False)
    """Share of every layer's experts removed (rounded to whole experts; an explicit share, e.g. before a stage that
    solves the rest of the target); None: keep, or solved from the recipe target."""
    allocation: ExpertAllocation = "uniform"
    """uniform: the same kept count in every layer (needed by GGUF and plain Hugging Face exports); global: each
    next removal where it costs least (per-layer counts differ; the target lands within one expert)."""
    tokens: int = Field(1024, ge=1)
    """Router input tokens per layer kept for the naee search and the merge (sampled evenly over the batches; each
    layer's every-expert outputs on them are held while it is searched: experts x tokens x hidden floats)."""
    max_candidates: int = Field(5000, ge=1)
    """naee: try every kept set when there are at most this many, else search greedily."""
    batches: int | None = Field(None, ge=1)
    """Calibration batches to read; None: all."""

    @model_validator(mode="after")
    def _one_amount(self) -> ExpertPruneArgs:
        if self.keep is not None and self.ratio is not None:
            raise ValueError("keep and ratio: give one of them (or neither, to solve the recipe target)")
        return self

    def budget(self) -> BudgetMode:
        return "solve" if self.keep is None and self.ratio is None else "explicit"

    def removed_per_layer(self, block: MoEBlock) -> int | None:
        """Experts ``block`` loses by ``keep`` or ``ratio`` (None: solved from the target)."""
        if self.keep is not None:
            return block.num_experts - self.keep
        if self.ratio is not None:  # a group-limited router loses the same number from every group
            groups = block.router_groups
            return round(self.ratio * block.num_experts / groups) * groups
        return None

    def plan(self, ctx: Context) -> int:
        if self.budget() != "explicit":
            return 0
        return sum(max(0, self.removed_per_layer(b) or 0) * b.expert_params() for b in moe_blocks(ctx.model))

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """One forward's activations and every expert's float32 outputs on the stage's search tokens (the router
        inputs wait on the CPU)."""
        memory = StageMemory(stage, advice=f"{ACTIVATION_ADVICE}, or lower {stage}'s tokens")
        memory.parts["activations"] = forward_activation_bytes(inputs.shape, inputs.tokens, inputs.dtype_bytes)
        memory.parts["expert outputs"] = max(inputs.shape.experts, 1) * self.tokens * inputs.shape.hidden * FLOAT32
        return memory

    def needs_calibration(self) -> bool:
        return True

    def operations(self) -> frozenset[str]:
        return frozenset({"expert"})

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)  # a dense architecture: refused with its reason
        check_all_sparse(model.config)
        blocks = moe_blocks(model)
        if not blocks:
            raise SlimkitError("prune_experts: the model has no MoE layer left")
        for block in blocks:
            removed = self.removed_per_layer(block) if self.ratio is not None else None
            if removed is not None and block.num_experts - removed < block.top_k:
                raise SlimkitError(
                    f"prune_experts: ratio {self.ratio} leaves layer {block.index} {block.num_experts - removed} "
                    f"experts, fewer than the router's top-k {block.top_k}; lower ratio"
                )
        if self.keep is not None:
            for block in blocks:
                if self.keep < block.top_k or self.keep > block.num_experts:
                    raise SlimkitError(
                        f"prune_experts: keep {self.keep} is outside layer {block.index}'s {block.top_k}-"
                        f"{block.num_experts} (at least the router's top-k, at most the experts it has)"
                    )
        grouped = [b.index for b in blocks if b.router_groups > 1]
        if grouped and self.allocation == "global" and self.budget() == "solve":
            raise SlimkitError(
                f"prune_experts: allocation global removes experts one at a time, and layer {grouped[0]}'s router "
                "picks among groups of experts (n_group) that must keep equal counts; use allocation: uniform"
            )
        if self.allocation == "uniform" and len({b.num_experts for b in blocks}) > 1 and self.budget() == "solve":
            raise SlimkitError(
                "prune_experts: allocation uniform needs the same expert count in every layer to solve the target; "
                "give keep, or use allocation: global"
            )

    def reach_check(self, ctx: Context, stage: str) -> None:
        """A target solved with whole experts is checked reachable on the shapes, before calibration."""
        if self.budget() == "solve":
            check_expert_reach(ctx, self, stage)


def check_expert_reach(ctx: Context, args: ExpertPruneArgs, name: str) -> None:
    """Refuse, in one line and before any compute, a strict target whole experts cannot land on within its
    tolerance, or one that needs more experts than the layers can lose (:func:`expert_reach`)."""
    blocks = moe_blocks(ctx.model)
    if not blocks:
        return
    target = ctx.recipe.target
    dense = ctx.params_before[target.part]
    uniform = args.allocation == "uniform"
    removable = [b.num_experts - b.top_k for b in blocks]
    reach = expert_reach(
        ctx.params_to_remove(), blocks[0].expert_params(), removable, uniform, round(target.tolerance * dense)
    )
    where = "from every layer" if uniform else "in all"
    if reach.too_many:
        most = (
            f"the {reach.most} a layer can lose (it keeps"
            if uniform
            else f"the {reach.most} the layers can lose (each keeps"
        )
        raise SlimkitError(
            f"{name}: the target needs {reach.count} experts removed {where}, more than {most} its top-k); lower "
            "target.ratio"
        )
    if reach.lands or not target.strict:
        return

    def ratio(removed: int) -> str:
        return f"{max(0.0, target.ratio + (removed - reach.wanted) / dense):.2%}"

    raise SlimkitError(
        f"{name}: whole experts cannot remove {target.ratio:.1%} of {target.of} within target.tolerance "
        f"{target.tolerance:.1%}: {reach.count} expert(s) {where} remove {ratio(reach.removed)}, the nearest counts "
        f"{' or '.join(ratio(r) for r in reach.nearest())}; set a target.ratio whole experts reach, widen "
        "target.tolerance" + (", or use allocation: global (one expert at a time)" if uniform else "")
    )


class ExpertMergeArgs(ExpertPruneArgs):
    scorer: ExpertScorer = "frequency"
    """How a layer's kept (dominant) experts are chosen before the others merge into them: frequency (MC-SMoE's
    dominant experts), weight, or naee."""
    damp: float = Field(1e-4, ge=0.0, allow_inf_nan=False)
    """Ridge of the router refit, relative to the mean diagonal of the sampled inputs' Gram."""


def _removals(
    ctx: Context, args: ExpertPruneArgs, blocks: list[MoEBlock], curves: dict[int, list[float]]
) -> dict[int, int]:
    """Experts each layer loses."""
    if args.budget() == "explicit":
        return {b.index: args.removed_per_layer(b) or 0 for b in blocks}
    cost = blocks[0].expert_params()
    wanted = ctx.params_to_remove()
    most = {b.index: b.num_experts - b.top_k for b in blocks}
    if args.allocation == "uniform":
        groups = blocks[0].router_groups  # a group-limited router loses the same number from every group
        per_layer = round(wanted / (cost * len(blocks) * groups)) * groups
        if per_layer > min(most.values()):
            raise SlimkitError(
                f"prune_experts: the target needs {per_layer} experts removed from every layer, more than the "
                f"{min(most.values())} a layer can lose (it keeps its top-k); lower target.ratio"
            )
        return dict.fromkeys(most, per_layer)
    total = round(wanted / cost)
    if total > sum(most.values()):
        raise SlimkitError(
            f"prune_experts: the target needs {total} experts removed, more than the {sum(most.values())} the layers "
            "can lose (each keeps its top-k); lower target.ratio"
        )
    return allocate_removals(curves, total, most)


def _layer_curve(args: ExpertPruneArgs, weights: ExpertWeights, stats: ExpertRouting, x: Any) -> list[float]:
    if args.scorer == "naee":
        return naee_search(weights, x, weights.top_k, max_candidates=0, curve_to=weights.top_k).curve
    return dropped_share_curve(router_scores(stats, args.scorer))


def run_expert_stage(ctx: Context, args: ExpertPruneArgs) -> StageResult:
    """The body of ``prune_experts`` and ``merge_experts`` (:class:`ExpertMergeArgs`: merge the dropped experts)."""
    merge = isinstance(args, ExpertMergeArgs)
    name = "merge_experts" if merge else "prune_experts"
    args.check_model(ctx.model)
    if args.budget() == "solve":
        check_expert_reach(ctx, args, name)  # before the calibration pass (a later block's stage included)
    start = time.perf_counter()
    batches = ctx.calibration_batches()[: args.batches] if args.batches else ctx.calibration_batches()
    sample = args.tokens if (args.scorer == "naee" or merge) else 0
    stats = collect_routing(ctx.model, batches, keep_inputs=sample, stats_device="cpu")
    blocks = [b for b in moe_blocks(ctx.model) if b.index in stats]

    def inputs(block: MoEBlock) -> Any:
        x = stats[block.index].inputs
        return None if x is None else x.to(block.router.weight.device, block.router.weight.dtype)

    curves: dict[int, list[float]] = {}
    if args.budget() == "solve" and args.allocation == "global":
        with ctx.tracker.task(f"{name}: loss curves", len(blocks)) as advance:
            for block in blocks:
                curves[block.index] = _layer_curve(args, ExpertWeights.of(block), stats[block.index], inputs(block))
                advance(1)
    removals = _removals(ctx, args, blocks, curves)
    layers: list[dict[str, Any]] = []
    with ctx.tracker.task(name, len(blocks)) as advance:
        for block in blocks:
            layer_stats, weights = stats[block.index], ExpertWeights.of(block)
            keep = block.num_experts - removals[block.index]
            entry: dict[str, Any] = {"layer": block.index, "experts_before": block.num_experts}
            if args.scorer == "naee":
                found = naee_search(weights, inputs(block), keep, max_candidates=args.max_candidates)
                kept = found.kept
                entry.update(loss=round(found.loss, 6), candidates=found.candidates, exhaustive=found.exhaustive)
            else:
                kept = keep_top(router_scores(layer_stats, args.scorer), keep, block.router_groups)
            if isinstance(args, ExpertMergeArgs) and keep < block.num_experts:
                x = inputs(block)
                plan = assign_dropped(weights, kept, x)
                set_expert_weights(block, merged_weights(weights, plan, layer_stats.mass, x, damp=args.damp))
                entry["merged"] = {str(k): v[1:] for k, v in plan.clusters.items() if len(v) > 1}
            else:
                keep_experts(block, kept)
            entry.update(kept=kept, kept_mass=round(layer_stats.kept_mass(kept), 6))
            layers.append(entry)
            advance(1)
    mean_mass = sum(e["kept_mass"] for e in layers) / max(len(layers), 1)
    ctx.notes.append(
        f"{name}: kept experts per layer, with the share of routing mass they held on the calibration text "
        f"(mean {mean_mass:.1%}): "
        + "; ".join(f"layer {e['layer']}: {','.join(map(str, e['kept']))} ({e['kept_mass']:.1%})" for e in layers)
    )
    counts = sorted({len(e["kept"]) for e in layers})
    if len(counts) > 1:
        ctx.notes.append(
            f"{name}: layers keep different expert counts ({counts[0]}-{counts[-1]}); GGUF and plain Hugging Face "
            "exports need the same count in every layer (allocation: uniform)"
        )
    return StageResult(
        {
            "seconds": round(time.perf_counter() - start, 2),
            "calibration_tokens": sum(int(b.numel()) for b in batches),
            "scorer": args.scorer,
            "allocation": args.allocation if args.budget() == "solve" else "explicit",
            "experts_kept": [len(e["kept"]) for e in layers],
            "routing_mass_kept": round(mean_mass, 6),
            "removed_params": sum(removals[b.index] * b.expert_params() for b in blocks),
            "layers": layers,
        }
    )


@register_stage(
    "prune_experts",
    args=ExpertPruneArgs,
    paper="NAEE (Lu et al. 2024, 'Not All Experts are Equal', Sec. 3.1): expert pruning by the reconstruction loss "
    "of the layer output over candidate kept sets; router frequency / routing weight baselines",
)
class PruneExperts:
    """Remove whole routed experts (router rows and fused expert slices), chosen per layer by the scorer."""

    def run_model(self, ctx: Context, args: ExpertPruneArgs) -> StageResult:
        return prune_experts(ctx, args)


def prune_experts(ctx: Context, args: ExpertPruneArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    return run_expert_stage(ctx, args)


@register_stage(
    "merge_experts",
    args=ExpertMergeArgs,
    paper="MC-SMoE (Li et al. 2024): dominant experts by routing frequency, the others merged into them weighted by "
    "frequency; HC-SMoE (Chen et al. 2024): grouping by expert-output similarity",
)
class MergeExperts:
    """Keep the dominant experts and merge every other expert into its most similar kept one, refitting the router."""

    def run_model(self, ctx: Context, args: ExpertMergeArgs) -> StageResult:
        return merge_experts(ctx, args)


def merge_experts(ctx: Context, args: ExpertMergeArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    return run_expert_stage(ctx, args)


__all__ = ["ExpertMergeArgs", "ExpertPruneArgs", "merge_experts", "prune_experts"]
