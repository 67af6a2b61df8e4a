"""Running layer-scoped stages one layer at a time: each layer runs on its captured inputs, its stages apply with the
statistics of that pass, then it produces the next layer's inputs (from the compressed layer in a ``sequential``
block, from the dense one at the top level). Only one layer's activations are alive at a time.

Method note: docs/methods/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from slimkit.engine.capabilities import ReadsLayerStatistics
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import BlockPosition, LayerStats
from slimkit.engine.stage import LayerStage
from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import LayerInputs, capture_layer_inputs, input_norm_hooks, run_layer
from slimkit.primitives.device.offload import resident
from slimkit.primitives.reconstruct.consumer import dense_consumer, paired_pass
from slimkit.primitives.reconstruct.gram import gram_hooks
from slimkit.recipes.catalogue import StageDef
from slimkit.recipes.stage_args import ReadsData, StageArgs, offered


@dataclass(frozen=True)
class BlockMember:
    """One layer stage of a block: its definition, arguments, layer form and its own state for the block."""

    definition: StageDef
    args: StageArgs
    stage: LayerStage[Any, Any]
    state: Any

    def statistics(self) -> ReadsLayerStatistics:
        """What it reads of the block's statistics pass beyond the input norms."""
        return offered(self.args, ReadsLayerStatistics)


def run_layerwise(
    ctx: Context,
    members: list[BlockMember],
    propagate: Literal["dense", "compressed"],
    on_layer: Callable[[int], None] | None = None,
) -> None:
    """Run the block's stages on every layer in turn (one layer's activations alive at a time)."""
    view = ctx.view
    needs_stats = any(offered(m.args, ReadsData).needs_calibration() for m in members)
    inputs = capture_layer_inputs(ctx.model, view.layer(0).module, ctx.calibration_batches()) if needs_stats else None
    none: frozenset[LinearRole] = frozenset()
    targets = none.union(*(m.statistics().dense_targets() for m in members))
    # The dense stream starts equal to the compressed one (same embeddings); its tensors are replaced, never changed.
    dense = None
    if inputs is not None and targets and propagate == "compressed":
        dense = LayerInputs(list(inputs.hidden), inputs.kwargs)
    names = {id(module): name for name, module in ctx.model.named_modules()}
    for layer in view.layers:
        with resident(ctx.model, names[id(layer.module)], layer.module):
            _compress_layer(ctx, members, layer.index, inputs, propagate, dense)
        if on_layer is not None:
            on_layer(layer.index)


def layer_statistics(
    view: ModelView,
    layer: LayerView,
    inputs: LayerInputs,
    roles: Sequence[LinearRole] = (),
    paired: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    targets: frozenset[LinearRole] = frozenset(),
) -> tuple[LayerStats, list[torch.Tensor]]:
    """Run ``layer`` on ``inputs`` with hooks: the statistics a layer stage reads (``input_norms`` of every projection,
    ``dense_consumers`` of ``roles``: the weight and input Gram before any stage changes them, with the paired
    pass's cross terms for the dense ``targets``; ``tokens``, ``layer_inputs``) and the layer's outputs."""
    consumers: dict[str, nn.Module] = {r: layer.linear(r) for r in roles if r in layer.roles}  # not a removed block's
    with input_norm_hooks(view.linears([layer])) as accumulators, gram_hooks(consumers) as grams:
        outputs = run_layer(layer.module, inputs)
    stats = LayerStats(input_norms={path: acc.norms() for path, acc in accumulators.items()})
    if roles:  # the dense layer's consumers, before any stage of the block changes them
        stats.dense_consumers = {
            role: dense_consumer(module, grams[role], (paired or {}).get(role), role in targets)
            for role, module in consumers.items()
        }
    stats.tokens = inputs.tokens
    stats.layer_inputs = inputs
    return stats, outputs


def _compress_layer(
    ctx: Context,
    members: list[BlockMember],
    index: int,
    inputs: LayerInputs | None,
    propagate: Literal["dense", "compressed"],
    dense: LayerInputs | None = None,
) -> None:
    """Calibrate layer ``index`` on ``inputs``, run the stages on it, and advance ``inputs`` (and the dense stream
    ``dense``, when there is one) to its outputs.

    ``stats.block`` tells a stage where it runs: ``propagate`` and the names of the block's stages before it
    (``earlier``), so a stage that needs an earlier one (``reconstruct``) can say so."""
    layer = ctx.view.layer(index)
    stats = LayerStats()
    outputs: list[torch.Tensor] = []
    dense_outputs = None
    if inputs is not None:
        none: frozenset[LinearRole] = frozenset()
        roles = sorted(none.union(*(m.statistics().layer_grams() for m in members)))
        targets = sorted(none.union(*(m.statistics().dense_targets() for m in members)) & set(roles))
        paired: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if dense is not None and targets:
            consumers: dict[str, nn.Module] = {r: layer.linear(r) for r in targets}
            paired, dense_outputs = paired_pass(layer.module, consumers, inputs, dense)
        stats, outputs = layer_statistics(ctx.view, layer, inputs, roles, paired, frozenset(targets))
    for position, member in enumerate(members):
        stats.block = BlockPosition(propagate, [m.definition.name for m in members[:position]])
        member.stage.run_layer(member.state, ctx.view.layer(index), stats)
    if inputs is not None:
        if propagate == "compressed":
            outputs = run_layer(ctx.view.layer(index).module, inputs)
        inputs.hidden = outputs
    if dense is not None and dense_outputs is not None:
        dense.hidden = dense_outputs
