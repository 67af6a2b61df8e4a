"""Reconstruction stage: refit a layer's consumer projections after units were removed.

Inside ``sequential``, after a stage that removed units of a layer (``prune_layer``), ``reconstruct`` refits the
projections that *read* the removed units (``down_proj`` for MLP channels, ``o_proj`` for heads) by damped least
squares on the block's calibration inputs, so the layer's output matches the dense layer's; a projection an earlier
stage made a low-rank pair gets its left factor refitted. ``bias: mean`` also moves the consumer's bias (fitted
jointly with the weights; architectures with no bias flag for the consumer are refused); ``target: dense`` fits the
dense model's output on the same tokens (a second activation stream through the block).

It refuses to run first in its ``sequential`` block, a projection whose columns another stage changed, ``damping``
below 1e-12, and a Gram matrix no damping makes solvable, each in one line. At the top level, after a model-scope
stage that removed units, it refits each layer against the dense model reloaded from the recipe's source
(:mod:`slimkit.stages.reconstruct_model`). The report gives, per role, the relative output error before and after
the refit, and the layers left ``unchanged``, ``removed_block`` or ``not_refitted``.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from slimkit.engine.capabilities import PlansMemory, ReadsLayerStatistics
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import FLOAT64, ModelShape
from slimkit.primitives.device.offload import is_offloaded
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct.bias import bias_refusal
from slimkit.primitives.reconstruct.refit import READS, RefitSettings, refit_role
from slimkit.recipes.stage_args import ChangesProjections, ReadsData, StageArgs


class ReconstructArgs(RefitSettings, StageArgs, ReadsData, ChangesProjections, PlansMemory, ReadsLayerStatistics):
    roles: list[LinearRole] | None = Field(default=None, min_length=1)
    """Projections to refit: down (reads the MLP channels) and o (reads the attention heads) after units were
    removed, and any role (q, k, v, o, gate, up, down) that an earlier stage made a low-rank pair (its left factor
    is refitted). Unset: down and o, each in the layers where it lost inputs or is low-rank. Given: the run fails
    when none was refitted in any layer, and the report names the ones that were not."""

    @property
    def consumers(self) -> list[LinearRole]:
        """The roles to refit (both when ``roles`` is unset)."""
        return list(self.roles) if self.roles is not None else ["down", "o"]

    def needs_calibration(self) -> bool:
        return True

    def reloads_dense(self) -> bool:
        return True  # at the top level: its refit target

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        return consumer_solve_bytes(shape)

    def layer_grams(self) -> frozenset[LinearRole]:
        return frozenset(self.consumers)

    def refits(self) -> frozenset[LinearRole]:
        return frozenset(self.consumers)

    def dense_targets(self) -> frozenset[LinearRole]:
        return frozenset(self.consumers) if self.target == "dense" else frozenset()


def consumer_solve_bytes(shape: ModelShape) -> int:
    """A consumer's float64 input Gram, its kept block, the damped copy, the Cholesky factor and the solve's
    temporaries: about five d x d float64 matrices at once, d the wider of hidden and intermediate."""
    widest = max(shape.hidden, shape.intermediate)
    return 5 * widest * widest * FLOAT64


def _check_placement(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: LayerStats) -> None:
    """Refusals before the first refit of a block: outside ``sequential``, first in its block, or a bias the
    architecture cannot carry."""
    block = stats.block
    if stats.dense_consumers is None or block is None or block.propagate != "compressed":
        raise SlimkitError("reconstruct runs inside sequential, after the stage that removes units")
    if not block.earlier:
        raise SlimkitError(
            "reconstruct is the first stage of its sequential block, so nothing was removed to refit; put it right "
            "after the stage that removes units (prune_layer)"
        )
    check_bias(ctx, args, layer)


def check_bias(ctx: Context, args: ReconstructArgs, layer: LayerView) -> None:
    """Refuse ``bias: mean`` on a consumer the architecture or an offloaded model cannot give a bias."""
    if args.bias != "mean":
        return
    for role in (r for r in args.consumers if r in layer.roles):
        reason = bias_refusal(ctx.model, layer, role)
        if reason is not None:
            raise SlimkitError(f"reconstruct: bias: mean needs a bias on {role}, but {reason}")
        if layer.linear(role).bias is None and is_offloaded(ctx.model):
            raise SlimkitError(
                f"reconstruct: bias: mean would add biases to every layer's {role} family, which an offloaded model "
                "(model.max_memory) cannot take; leave max_memory unset or use bias: none"
            )


def new_entry(args: ReconstructArgs, **extra: Any) -> dict[str, Any]:
    """The report entry a refit fills: the settings, per-role summaries, per-layer results, unchanged layers."""
    settings = {"bias": args.bias, "target": args.target, "refit": args.refit}
    return {"settings": settings, **extra, "roles": {}, "layers": {}, "unchanged": {}}


def summarise_roles(entry: dict[str, Any]) -> None:
    """Each refitted role's mean relative output error before and after, over its layers, into ``entry["roles"]``."""
    for role, per_layer in entry["layers"].items():
        entry["roles"][role] = {
            "layers": len(per_layer),
            "mean_error_before": sum(r["error_before"] for r in per_layer.values()) / len(per_layer),
            "mean_error_after": sum(r["error_after"] for r in per_layer.values()) / len(per_layer),
        }


@dataclass
class ReconstructState:
    """A ``reconstruct`` stage across its ``sequential`` block: its report entry, filled layer by layer."""

    ctx: Context
    args: ReconstructArgs
    entry: dict[str, Any] = field(default_factory=dict)


@register_stage(
    "reconstruct",
    args=ReconstructArgs,
    paper="least-squares reconstruction of the kept inputs (as in SlimGPT / ZipLM / FLAP's refits); FLAP's bias "
    "compensation (bias: mean)",
)
class Reconstruct:
    """Refit down_proj / o_proj from the kept inputs so the layer's output matches the dense layer's."""

    def start(self, ctx: Context, args: ReconstructArgs) -> ReconstructState:
        return ReconstructState(ctx, args)

    def run_layer(self, state: ReconstructState, layer: LayerView, stats: LayerStats) -> None:
        ctx, args = state.ctx, state.args
        if not state.entry:  # before the first refit of the block
            _check_placement(ctx, args, layer, stats)
            state.entry = new_entry(args)
        entry = state.entry
        for role in args.consumers:
            if role not in layer.roles:  # its sub-block was removed (remove_blocks): nothing reads the removed units
                entry.setdefault("removed_block", {}).setdefault(role, []).append(layer.index)
                continue
            result = refit_role(layer, role, stats.consumer(role), args, ctx.model, ctx.view)
            if result is not None:
                entry["layers"].setdefault(role, {})[str(layer.index)] = result
            else:
                entry["unchanged"].setdefault(role, []).append(layer.index)
        summarise_roles(entry)
        if layer.index == len(ctx.view.layers) - 1 and args.roles is not None:
            check_roles_acted(ctx, args.roles, entry)

    def finish(self, state: ReconstructState) -> StageResult:
        return StageResult(state.entry)

    def run_model(self, ctx: Context, args: ReconstructArgs) -> StageResult:
        """At the top level of a recipe: each layer refit against the reloaded dense model
        (:mod:`slimkit.stages.reconstruct_model`)."""
        from slimkit.stages.reconstruct_model import reconstruct_top_level  # it imports this module

        return reconstruct_top_level(ctx, args, ctx.block.index)


def check_roles_acted(ctx: Context, roles: list[LinearRole], entry: dict) -> None:
    """After the last layer: fail when none of the roles asked for was refitted in any layer (the stage before
    produced nothing to refit); flag in the report (``not_refitted`` and a note) the ones that were not, when
    others were (e.g. ``[q, k, v, o, down]`` after LoRAP, whose allocation keeps v and o dense at some ratios)."""
    missing = [role for role in roles if role not in entry["layers"]]
    if not missing:
        return
    if len(missing) == len(roles):
        raise SlimkitError(
            f"reconstruct: roles asks to refit {', '.join(missing)}, but no stage before it removed the units "
            f"{' or '.join(READS.get(r, f'{r} reads') for r in missing)} in any layer"
            + ("" if set(missing) <= set(READS) else " or made them low-rank (q, k, v, gate, up: low-rank only)")
        )
    entry["not_refitted"] = missing
    ctx.notes.append(
        f"reconstruct: {', '.join(missing)} refitted in no layer (no units removed from their inputs and not "
        f"low-rank); refitted: {', '.join(r for r in roles if r in entry['layers'])}"
    )
