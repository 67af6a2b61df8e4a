"""The allocation pre-pass: each layer's share of a layer-wise removal, decided before the block runs.

Where it sits in a run: in the stages phase, inside a ``layerwise`` item (a ``sequential`` block or a layer stage at
the top level, :func:`slimkit.engine.dispatch.run_stages`), after the block's budget starts
(:meth:`~slimkit.engine.context.Context.start_block`) and before its first layer runs. Each stage of the block says
what it allocates through :meth:`~slimkit.engine.stage_args.StageArgs.allocation_prepass` (a :class:`PrePass`, or
None); the built-in ones are ``prune_layer`` / ``obs_prune_layer`` with ``allocation: global`` or ``search``
(:class:`~slimkit.stages.selection_prepass.UnitScores`) and ``lowrank`` with ``allocation: global``
(:class:`~slimkit.stages.lowrank_prepass.RankSpectra`):

1. **Scores, once per layer, on dense inputs** (:func:`dense_layer_statistics`): the block's calibration batches
   (less the search's held-out ones) are run through the model layer by layer as it is when the block starts, with
   the same statistics the layer-wise pass gathers (:func:`~slimkit.engine.layerwise.layer_statistics`), and the
   stage's own scorer ranks each eligible layer's units (``obs_prune_layer``: the one-shot OBS cost; ``lowrank``:
   each matrix's weighted spectrum). Stages that score on the same batches share one pass; only one layer's
   activations are alive at a time.
2. **Kept counts per layer and kind** landing on what is left of the target (``ctx.params_to_remove()``, within
   ``target.tolerance``), with the stage's rules and the target's alignment:
   ``global``: :func:`~slimkit.primitives.allocate.global_ranking`; ``search``:
   :func:`~slimkit.primitives.allocate.search_levels`, each candidate assembled by masking the lowest-scored units of
   each layer (:func:`~slimkit.primitives.allocate.masked_units`: no weight copied, no statistic recomputed) and
   scored by the KL divergence to the dense log-probabilities on the held-out batches
   (:func:`~slimkit.primitives.allocate.mean_kl`).
3. The counts are decided stage by stage in the block's order and stored in the block's cache
   (:class:`~slimkit.stages.allocation_results.LayerAllocation`); each layer's turn reads its own fraction
   (:func:`~slimkit.stages.allocation_results.allocated_fraction`), so the block removes exactly the planned parameters.
   Which units go is still chosen by the stage on that layer's (compressed-stream) statistics; only how many comes
   from here.

A target no plan of the units reaches is refused in one line naming the stage, the alignment and the nearest ratios.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
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
    ctx: Context, batches: list[torch.Tensor], roles: Sequence[str], last: int
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
