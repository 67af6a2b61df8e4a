"""``reconstruct`` at the top level of a recipe: refit down_proj / o_proj after a model-scope stage removed units.

The dense layers are brought back one at a time (:mod:`slimkit.stages.dense_source`) and the in-block refit
runs on the compressed stream's inputs.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import model_form
from slimkit.engine.stage import StageResult
from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import LayerInputs, capture_layer_inputs, run_layer
from slimkit.primitives.device.offload import resident
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import LowRankLinear
from slimkit.primitives.reconstruct.consumer import DenseConsumer, dense_consumer, paired_pass
from slimkit.primitives.reconstruct.gram import gram_hooks
from slimkit.primitives.reconstruct.refit import refit_role
from slimkit.recipes.catalogue import stage_def
from slimkit.recipes.schema import SequentialSpec
from slimkit.stages.dense_source import ReloadedDense, release_memory, reload_dense
from slimkit.stages.reconstruct import ReconstructArgs, check_bias, check_roles_acted, new_entry, summarise_roles

TOP_LEVEL_ROLES = ("down", "o")
UNITS = {"down": "MLP channels", "o": "attention heads"}
"""What each top-level role reads: the units a model-scope stage removes."""


@dataclass
class RefitPlan:
    """Which roles of which layers lost inputs (to refit) and which did not (left as they are)."""

    refit: dict[int, list[LinearRole]] = field(default_factory=dict)
    unchanged: dict[str, list[int]] = field(default_factory=dict)


def reconstruct_top_level(ctx: Context, args: ReconstructArgs, index: int) -> StageResult:
    """Refit every layer's down_proj / o_proj against the reloaded dense model, layer by layer on the compressed
    model's calibration stream (``reconstruct`` at ``stages.<index>``)."""
    roles = _check_recipe_placement(ctx, args, index)
    _check_compressed(ctx, args, roles)
    dense = reload_dense(
        ctx,
        "reconstruct",
        what="dense model",
        device="cpu",
        why="the top-level form",
        instead="put prune_layer and reconstruct in one sequential block",
        holds="the stage holds it in CPU memory beside the compressed model: about {need}",
    )
    cuda = any(p.device.type == "cuda" for p in ctx.model.parameters())
    try:
        return StageResult(_refit_against(ctx, args, roles, dense, f"{index}:reconstruct"))
    finally:
        del dense
        release_memory(cuda)


def _refit_against(
    ctx: Context, args: ReconstructArgs, roles: list[LinearRole], dense: ReloadedDense, label: str
) -> dict[str, Any]:
    """Plan against the dense model, run the pass (the dense model's views end here); returns the report entry."""
    dense_view = ModelView(dense.model)
    plan = refit_plan(ctx.view, dense_view, roles, args)
    entry = new_entry(
        args,
        placement="top level",
        dense_model={"source": dense.source, "load_seconds": dense.load_seconds, "weights": dense.weights},
    )
    entry["unchanged"] = plan.unchanged
    _refit_layers(ctx, dense_view, args, plan, entry, label)
    if args.roles is not None:  # some roles refitted in no layer (llm-pruner at 10% removes no heads): flagged
        check_roles_acted(ctx, args.roles, entry)
    return entry


def _check_recipe_placement(ctx: Context, args: ReconstructArgs, index: int) -> list[LinearRole]:
    """The roles to refit, after the refusals that need no model: first in the recipe, right after layer-scope work
    (where reconstruct belongs inside the block), roles the top-level form does not refit."""
    if index == 0:
        raise SlimkitError(
            "reconstruct is the first stage of the recipe, so nothing was removed to refit; put it after the stage "
            "that removes units (prune, cce)"
        )
    before = ctx.recipe.stages[index - 1]
    if isinstance(before, SequentialSpec):
        raise SlimkitError(
            f"reconstruct runs inside sequential, after the stage that removes units: move it to the end of the "
            f"sequential block at stages.{index - 1}; at the top level it follows a model-scope stage (prune, cce)"
        )
    definition = stage_def(before.stage)
    if definition.scope == "layer" and model_form(definition) is None:
        raise SlimkitError(
            f"reconstruct runs inside sequential, after the stage that removes units: put stages.{index - 1} "
            f"({before.stage}) and reconstruct in one sequential block; at the top level it follows a model-scope "
            "stage (prune, cce)"
        )
    others = [role for role in args.consumers if role not in TOP_LEVEL_ROLES]
    if others:
        raise SlimkitError(
            f"reconstruct: at the top level it refits down and o (after units were removed), not "
            f"{', '.join(others)}; a low-rank pair is refitted inside sequential, right after lowrank"
        )
    return list(args.consumers)


def _check_compressed(ctx: Context, args: ReconstructArgs, roles: list[LinearRole]) -> None:
    """Refusals on the compressed model, before the dense one is loaded: low-rank pairs, a bias it cannot carry."""
    for layer in ctx.view.layers:
        for role in (r for r in roles if r in layer.roles):
            if isinstance(layer.linear(role), LowRankLinear):
                raise SlimkitError(
                    f"reconstruct: layer {layer.index} {role} is a low-rank pair, which the top-level form does not "
                    f"refit; put reconstruct inside sequential right after lowrank, or leave {role} out of roles"
                )
    check_bias(ctx, args, ctx.view.layer(0))


def refit_plan(view: ModelView, dense: ModelView, roles: list[LinearRole], args: ReconstructArgs) -> RefitPlan:
    """Compare the compressed model with its dense source: the layers each role lost inputs in, and the refusals
    (another layer count, hidden size or head size; a role with nothing removed)."""
    if dense.num_layers != view.num_layers:
        raise SlimkitError(
            f"reconstruct: the model has {view.num_layers} layers and its source {dense.num_layers}; the top-level "
            "form refits layer i against the source's layer i, so no stage before it may remove layers"
        )
    if dense.hidden_size != view.hidden_size:
        raise SlimkitError(
            f"reconstruct: the model's hidden size is {view.hidden_size} and its source's {dense.hidden_size} (a stage "
            "removed hidden features), so the dense layers cannot read the compressed residual stream; drop "
            "hidden_feature from that stage's kinds (cce) or groups (prune), or recover with lora / distill instead"
        )
    plan = RefitPlan(unchanged={role: [] for role in roles})
    for layer in view.layers:
        dense_layer = dense.layer(layer.index)
        if layer.head_dim != dense_layer.head_dim:
            raise SlimkitError(
                f"reconstruct: layer {layer.index}'s head size is {layer.head_dim} and its source's "
                f"{dense_layer.head_dim}; the dense attention cannot run on the compressed model's position tables"
            )
        for role in (r for r in roles if r in layer.roles):  # a hybrid's layer holds some roles
            narrower = layer.linear(role).weight.shape[1] != dense_layer.linear(role).weight.shape[1]
            if narrower:
                plan.refit.setdefault(layer.index, []).append(role)
            else:
                plan.unchanged[role].append(layer.index)
    if not plan.refit:  # no role lost inputs in any layer (some missing is flagged after the pass)
        raise SlimkitError(
            f"reconstruct: {'roles asks to refit ' + ', '.join(roles) + ', but ' if args.roles is not None else ''}"
            f"no stage before it removed the units {' or '.join(f'{r} reads ({UNITS[r]})' for r in roles)} in any "
            "layer, so there is nothing to refit"
        )
    return plan


def _refit_layers(
    ctx: Context, dense: ModelView, args: ReconstructArgs, plan: RefitPlan, entry: dict, label: str
) -> None:
    """The layer-by-layer pass: dense statistics on the compressed stream, refit, advance, free the dense layer."""
    view = ctx.view
    inputs = capture_layer_inputs(ctx.model, view.layer(0).module, ctx.calibration_batches())
    # The dense stream (target: dense) starts equal to the compressed one; its tensors are replaced, never changed.
    stream = LayerInputs(list(inputs.hidden), inputs.kwargs) if args.target == "dense" else None
    device = inputs.hidden[0].device
    names = {id(module): name for name, module in ctx.model.named_modules()}
    with ctx.tracker.task(label, view.num_layers) as advance:
        for index in range(view.num_layers):
            roles = plan.refit.get(index, [])
            stats = LayerStats(dense_consumers=dense_consumers(dense.layer(index), roles, inputs, stream, device))
            dense.layer_list[index] = nn.Identity()  # free the dense layer (its snapshots hold clones)
            module = view.layer(index).module
            with resident(ctx.model, names[id(module)], module):
                layer = ctx.view.layer(index)
                for role in roles:
                    _record(entry, role, index, _refit(ctx, layer, role, stats, args))
                inputs.hidden = run_layer(layer.module, inputs)
            advance(1)
    summarise_roles(entry)


def dense_consumers(
    layer: LayerView, roles: list[LinearRole], inputs: LayerInputs, stream: LayerInputs | None, device
) -> dict[str, DenseConsumer]:
    """Run dense ``layer`` (moved to ``device``) on the compressed stream ``inputs`` with Gram hooks on its ``roles``
    projections: their :class:`DenseConsumer` snapshots. With a dense ``stream`` (``target: dense``) the layer also
    runs on it (paired, for the cross terms) and advances it. A layer with nothing to refit and no stream is not
    run (nor moved)."""
    if not roles and stream is None:
        return {}
    layer.module.to(device)
    consumers: dict[str, nn.Module] = {role: layer.linear(role) for role in roles}
    paired: dict = {}
    if stream is not None and roles:
        paired, stream.hidden = paired_pass(layer.module, consumers, inputs, stream)
    elif stream is not None:
        stream.hidden = run_layer(layer.module, stream)
    if not roles:
        return {}
    with gram_hooks(consumers) as grams:
        run_layer(layer.module, inputs)
    dense_target = stream is not None
    return {
        role: dense_consumer(module, grams[role], paired.get(role), dense_target) for role, module in consumers.items()
    }


def _refit(ctx: Context, layer: LayerView, role: LinearRole, stats: LayerStats, args: ReconstructArgs) -> dict | None:
    """The in-block refit of one role (:func:`~slimkit.primitives.reconstruct.refit.refit_role`) with the stage's
    settings."""
    return refit_role(layer, role, stats.consumer(role), args, ctx.model, ctx.view)


def _record(entry: dict, role: str, index: int, result: dict | None) -> None:
    """A refit's report entry; a role whose width differs but whose refit found nothing to do is ``unchanged``."""
    if result is None:
        entry["unchanged"].setdefault(role, []).append(index)
    else:
        entry["layers"].setdefault(role, {})[str(index)] = result
