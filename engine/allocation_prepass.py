"""The allocation pre-pass: each layer's share of a layer-wise removal, decided before the block runs, from scores on
dense inputs and each stage's :meth:`~slimkit.engine.stage_args.StageArgs.allocation_prepass`.

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from typing import Protocol

import torch

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.layerwise import layer_statistics
from slimkit.primitives.arch import LayerView
from slimkit.primitives.calibration import capture_layer_inputs
from slimkit.primitives.device.offload import resident
from slimkit.recipes.schema import StageSpec


class PrePass(Protocol):
    """One allocating stage's part of the block's pre-pass: what it reads of the shared dense pass, what it does with
    each layer's statistics, and its decision once every layer was seen."""

    scoring_batches: int | None
    """How many of the calibration batches (the first ones) it scores on; None: the weights alone (no forward)."""
    roles: frozenset[str]
    """The projections whose input Grams it reads."""
    last: int
    """The last layer it reads."""

    def visit(self, layer: LayerView, stats: LayerStats) -> None: ...

    def decide(self, ctx: Context) -> None:
        """Store the allocation in the block's cache (and, for a fixed-budget stage, make the block's plan exact)."""


def allocate_block(ctx: Context, children: list[StageSpec]) -> None:
    """Run the pre-pass for every stage of the block that allocates (the dispatcher calls this before the block).

    The stages that score on the same calibration batches share one dense pass (one forward of the block's model,
    layer by layer, with the union of the statistics they read); then each decides in the block's order, so a
    ``lowrank`` stage's exact plan is known when a solving stage after it takes what is left of the target."""
    passes: list[PrePass] = []
    for spec in children:
        part = spec.parsed_args().allocation_prepass(ctx, spec.stage)
        if part is not None:
            passes.append(part)
    if not passes:
        return
    began = time.perf_counter()
    for count in {p.scoring_batches for p in passes}:
        sharing = [p for p in passes if p.scoring_batches == count]
        roles = frozenset().union(*(p.roles for p in sharing))
        last = max(p.last for p in sharing)
        if count is None:
            layers = _weights_only(ctx, last)
        else:
            layers = dense_layer_statistics(ctx, ctx.calibration_batches()[:count], roles, last)
        for layer, stats in layers:
            for part in sharing:
                if layer.index <= part.last:
                    part.visit(layer, stats)
    ctx.block_cache["allocation:pass_seconds"] = round(time.perf_counter() - began, 3)
    for part in passes:
        part.decide(ctx)


def _weights_only(ctx: Context, last: int) -> Iterator[tuple[LayerView, LayerStats]]:
    """Layers 0 to ``last`` with no statistics (a stage that reads the weights alone), each resident while read."""
    names = {id(module): name for name, module in ctx.model.named_modules()}
    for layer in ctx.view.layers[: last + 1]:
        with resident(ctx.model, names[id(layer.module)], layer.module):
            yield layer, LayerStats()


def dense_layer_statistics(
    ctx: Context, batches: list[torch.Tensor], roles: Collection[str], last: int
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


__all__ = ["PrePass", "allocate_block", "dense_layer_statistics"]
