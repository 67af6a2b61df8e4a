"""The allocation pre-pass: each layer's share of a layer-wise removal, decided before the block runs, from scores on
dense inputs and each allocating stage's part (:class:`~slimkit.engine.stage.AllocatingStage`).

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator

import torch

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.layerwise import BlockMember, layer_statistics
from slimkit.engine.registry import allocating_form
from slimkit.engine.stage import PrePass
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import capture_layer_inputs
from slimkit.primitives.device.offload import resident


def allocate_block(ctx: Context, members: list[BlockMember]) -> None:
    """Run the pre-pass for every stage of the block that allocates (the dispatcher calls this before the block).

    The stages that score on the same calibration batches share one dense pass (one forward of the block's model,
    layer by layer, with the union of the statistics they read); then each decides in the block's order, so a
    ``lowrank`` stage's exact plan is known when a solving stage after it takes what is left of the target."""
    passes: list[PrePass] = []
    for member in members:
        allocating = allocating_form(member.definition)
        part = allocating.allocation_prepass(member.state) if allocating is not None else None
        if part is not None:
            passes.append(part)
    if not passes:
        return
    began = time.perf_counter()
    for count in {p.scoring_batches for p in passes}:
        sharing = [p for p in passes if p.scoring_batches == count]
        none: frozenset[LinearRole] = frozenset()
        roles = none.union(*(p.roles for p in sharing))
        last = max(p.last for p in sharing)
        if count is None:
            layers = _weights_only(ctx, last)
        else:
            layers = dense_layer_statistics(ctx, ctx.calibration_batches()[:count], roles, last)
        for layer, stats in layers:
            for part in sharing:
                if layer.index <= part.last:
                    part.visit(layer, stats)
    pass_seconds = round(time.perf_counter() - began, 3)
    for part in passes:
        part.decide(ctx, pass_seconds)


def _weights_only(ctx: Context, last: int) -> Iterator[tuple[LayerView, LayerStats]]:
    """Layers 0 to ``last`` with no statistics (a stage that reads the weights alone), each resident while read."""
    names = {id(module): name for name, module in ctx.model.named_modules()}
    for layer in ctx.view.layers[: last + 1]:
        with resident(ctx.model, names[id(layer.module)], layer.module):
            yield layer, LayerStats()


def dense_layer_statistics(
    ctx: Context, batches: list[torch.Tensor], roles: Collection[LinearRole], last: int
) -> Iterator[tuple[LayerView, LayerStats]]:
    """The model as it is when the block starts, run layer by layer (0 to ``last``) on ``batches``: each layer with
    the statistics the layer-wise pass gathers (:func:`~slimkit.engine.layerwise.layer_statistics`, the Grams of
    ``roles``). Only one layer's activations are alive at a time; an offloaded layer is resident while it runs."""
    view = ctx.view
    inputs = capture_layer_inputs(ctx.model, view.layer(0).module, batches)
    names = {id(module): name for name, module in ctx.model.named_modules()}
    for layer in view.layers[: last + 1]:
        with resident(ctx.model, names[id(layer.module)], layer.module):
            stats, outputs = layer_statistics(view, layer, inputs, sorted(roles))
            yield layer, stats
        inputs.hidden = outputs
        del stats, outputs


__all__ = ["allocate_block", "dense_layer_statistics"]
