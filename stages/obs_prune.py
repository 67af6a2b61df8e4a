"""OBS structured pruning stage: choose and remove units by greedy optimal brain surgeon.

``obs_prune_layer`` (layer scope, inside ``sequential``) removes MLP channels and attention heads of one layer the
way ZipLM / SlimGPT do: it repeatedly removes the consumer's column group (``down_proj`` per channel, ``o_proj`` per
head) whose removal, with the optimal update of the remaining columns, raises the output error least; the producers
are then sliced by ``prune_layer``'s surgery. Budget: as ``prune_layer`` (``ratio``, ``ratio_rule: solve`` or
``layer``; ``allocation: {global: ...}`` or ``{search: ...}`` takes each layer's count from the block's pre-pass).
Under GQA each KV group loses the same number of heads. A consumer another stage of the block already changed is
refused in one line: put ``obs_prune_layer`` first. ``damping`` must be positive. The report gives the removed
units and the relative output error with and without the OBS update.

Method note: docs/methods/reconstruct-obs.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from slimkit.engine.capabilities import PlansMemory, ReadsLayerStatistics
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import PrePass, StageResult
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import ModelShape
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.importance import ScorerSpec, parse_scorer
from slimkit.primitives.importance.obs_saliency import OBS_CONSUMERS
from slimkit.primitives.reconstruct import DEFAULT_OBS_DAMPING, embed_columns, obs_prune, output_error
from slimkit.primitives.select import eligible_layers
from slimkit.primitives.select.plan import Fraction, SelectionRules, check_shapes, kept_counts, validate_counts
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.stage_args import ChangesProjections
from slimkit.stages.allocation_results import LayerAllocation, allocated_fraction
from slimkit.stages.prune import layer_fraction, planned_layer_removal
from slimkit.stages.reconstruct import consumer_solve_bytes
from slimkit.stages.scoring import roles_of
from slimkit.stages.selection import SelectionArgs
from slimkit.stages.selection_prepass import UnitScores

ObsKind = Literal["mlp_channel", "attention_head"]


class ObsPruneLayerArgs(SelectionArgs[ObsKind], ChangesProjections, PlansMemory, ReadsLayerStatistics):
    allocates: ClassVar[bool] = True

    damping: float = Field(DEFAULT_OBS_DAMPING, gt=0.0, allow_inf_nan=False)
    """OBS Hessian damping as a fraction of mean(diag(G)) (ZipLM / SparseGPT percdamp 0.01); > 0."""
    per_update: int = Field(1, ge=1)
    """Units removed per inverse-Hessian update (SlimGPT's batched greedy: the cheapest this many at once, exact OBS
    on their union); 1: one at a time. Larger values cut the updates of a wide consumer's inverse (8B: 14,336
    columns) by that factor."""

    def rules(self) -> SelectionRules:
        """prune_layer's selection rules (uniform, no protected units)."""
        round_to: dict[str, int] = {kind: multiple for kind, multiple in self.round_to.items()}
        return SelectionRules("uniform", round_to, self.min_keep, 0.0)

    def needs_calibration(self) -> bool:
        return True

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        return consumer_solve_bytes(shape)  # the consumer's Gram, as reconstruct's

    def allocation_scorer(self) -> tuple[ScorerSpec, dict]:
        """The allocation pre-pass ranks units by their one-shot OBS cost (the ``obs`` scorer: the greedy's first
        step, damping 0.01) on the dense consumer Grams."""
        return parse_scorer("obs"), {}

    def plan(self, ctx: Context) -> int:
        return planned_layer_removal(ctx, self)

    def touches(self) -> frozenset[LinearRole]:
        return roles_of(self.groups)

    def layer_grams(self) -> frozenset[LinearRole]:
        return frozenset(OBS_CONSUMERS[kind] for kind in self.groups)

    def rewrites_kept(self) -> frozenset[LinearRole]:
        return frozenset(OBS_CONSUMERS[kind] for kind in self.groups)


def consumer_columns(group: Group, module: nn.Module, model: nn.Module) -> torch.Tensor:
    """``[units, per_unit]`` input columns of ``module`` (the consumer) that the group's units occupy."""
    for member in group.members:
        if member.param == "weight" and member.dim == 1 and model.get_submodule(member.module) is module:
            return member.indices
    raise SlimkitError(f"obs_prune_layer: layer {group.layer} {group.kind} has no input columns of its consumer")


def _consumer(layer: LayerView, kind: str, stats: LayerStats) -> nn.Linear:
    """The consumer of ``kind`` in ``layer``, checked to be the plain dense projection the statistics saw."""
    role = OBS_CONSUMERS[kind]
    module = layer.linear(role)
    snapshot = stats.consumer(role)
    weight = getattr(module, "weight", None)
    if (
        not isinstance(module, nn.Linear)
        or weight is None
        or weight.shape != snapshot.weight.shape
        or not torch.equal(weight.detach(), snapshot.weight.to(weight.device))
    ):
        raise SlimkitError(
            f"obs_prune_layer: layer {layer.index} {role} was changed by an earlier stage of the block; "
            "OBS needs the dense consumer, so put obs_prune_layer first in its sequential block"
        )
    return module


def _prune_group(
    ctx: Context, layer: LayerView, group: Group, kept: int, stats: LayerStats, args: ObsPruneLayerArgs
) -> dict:
    """Greedy OBS on the group's consumer, then remove the chosen units and write the updated consumer."""
    role = OBS_CONSUMERS[group.kind]
    module = _consumer(layer, group.kind, stats)
    snapshot = stats.consumer(role)
    columns = consumer_columns(group, module, ctx.model)
    width = snapshot.weight.shape[1]
    result = obs_prune(
        snapshot.weight,
        snapshot.gram,
        list(columns),
        group.size - kept,
        damping=args.damping,
        blocks=group.extra.get("kv_groups", 1),
        per_update=args.per_update,
    )
    unrefit = embed_columns(
        snapshot.weight[:, result.kept_columns.to(snapshot.weight.device)], result.kept_columns, width
    )
    error_unrefit = output_error(snapshot.weight, unrefit, snapshot.gram, relative=True)
    error = output_error(snapshot.weight, embed_columns(result.weight, result.kept_columns, width), snapshot.gram, True)
    remove_units(ctx.model, group, torch.tensor(result.kept_groups, dtype=torch.long))
    target = layer.linear(role)
    if target.weight.shape != result.weight.shape:  # surgery and OBS must agree on the kept columns
        raise SlimkitError(
            f"obs_prune_layer: layer {layer.index} {role} has shape {tuple(target.weight.shape)} after surgery, "
            f"OBS kept {tuple(result.weight.shape)}"
        )
    with torch.no_grad():
        target.weight.copy_(result.weight.to(device=target.weight.device, dtype=target.weight.dtype))
    return {
        "kept": kept,
        "of": group.size,
        "removed": result.removed_groups,
        "error": error,
        "error_unrefit": error_unrefit,
        "damping": result.info.damping,
        "method": result.info.method,
    }


@dataclass
class ObsPruneState:
    """An ``obs_prune_layer`` stage across its block: the pre-pass's allocation, else the uniform fraction solved at
    the first eligible layer (on the block's shapes), and the report entry filled layer by layer."""

    ctx: Context
    args: ObsPruneLayerArgs
    allocation: LayerAllocation | None = None
    fraction: Fraction | None = None
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per consumer role and layer, what the greedy removed and the output errors."""

    def entry(self) -> dict[str, Any]:
        """The report entry; with an allocation, ``allocation`` holds the per-layer shares and ``unit_fraction`` the
        mean fraction of each kind over the layers."""
        args = self.args
        entry: dict[str, Any] = {
            "unit_fraction": self.fraction,
            "groups": list(args.groups),
            "damping": args.damping,
            "roles": {
                role: {
                    "layers": len(per_layer),
                    "mean_error": sum(r["error"] for r in per_layer.values()) / len(per_layer),
                    "mean_error_unrefit": sum(r["error_unrefit"] for r in per_layer.values()) / len(per_layer),
                }
                for role, per_layer in self.layers.items()
            },
        }
        if self.allocation is not None:
            entry = {**entry, "unit_fraction": self.allocation.report["mean_unit_fraction"]}
            entry["allocation"] = self.allocation.report
        return {**entry, "layers": self.layers}


@register_stage(
    "obs_prune_layer",
    args=ObsPruneLayerArgs,
    paper="ZipLM (Kurtic et al. 2023) Eqs. 2-3 / SlimGPT (Ling et al. 2024): greedy structured OBS, layer by layer",
)
class ObsPruneLayer:
    """Choose and remove one layer's MLP channels / heads by greedy OBS, updating down_proj / o_proj."""

    def start(self, ctx: Context, args: ObsPruneLayerArgs) -> ObsPruneState:
        return ObsPruneState(ctx, args)

    def allocation_prepass(self, state: ObsPruneState) -> PrePass | None:
        """With ``allocation: global`` or ``search``: units ranked by their one-shot OBS cost on the block's dense
        pass, then kept counts per layer."""
        if state.args.allocation_settings() == "uniform":
            return None
        return UnitScores(state.ctx, "obs_prune_layer", state.args, state)

    def run_layer(self, state: ObsPruneState, layer: LayerView, stats: LayerStats) -> None:
        ctx, args = state.ctx, state.args
        if stats.dense_consumers is None:
            raise SlimkitError("obs_prune_layer needs the layer's calibration statistics (run it inside sequential)")
        if layer.index not in eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last):
            return
        fraction = allocated_fraction("obs_prune_layer", args, state.allocation, layer.index)  # the pre-pass's share
        if fraction is None:
            if state.fraction is None:  # solved once per block, on the shapes the block started with
                state.fraction = layer_fraction(ctx, args, "obs_prune_layer")  # prune_layer's budget, these rules
            fraction = state.fraction
        # a layer whose sub-block of a kind was removed (remove_blocks) has no group of that kind
        groups = [g for kind in args.groups for g in build_groups(ctx.model, kind, [layer.index])]
        if not groups:
            return
        rules = args.rules_for(ctx.recipe.target)
        check_shapes(groups, rules)
        counts = kept_counts(groups, [torch.zeros(g.size) for g in groups], fraction, rules)
        validate_counts(groups, counts, fraction, rules)
        for group in groups:  # every consumer is checked before any weight changes
            _consumer(layer, group.kind, stats)
        for group, kept in zip(groups, counts, strict=True):
            role = OBS_CONSUMERS[group.kind]
            state.layers.setdefault(role, {})[str(layer.index)] = _prune_group(ctx, layer, group, kept, stats, args)

    def finish(self, state: ObsPruneState) -> StageResult:
        return StageResult(state.entry())
