"""Running layer-scoped stages one layer at a time.

For each layer: run it on its captured inputs with hooks that accumulate each projection's input
norms, apply the stages with those statistics, then produce the next layer's inputs. With
``propagate="compressed"`` (the ``sequential`` stage) the next inputs come from the compressed
layer, so later layers see the errors of earlier ones, as SparseGPT/Wanda/LoRAP do; with
``"dense"`` (a layer stage at the top level) they come from the layer before compression, which
equals calibrating the whole dense model once. Only one layer's activations are alive at a time,
so peak memory is the model plus one layer's calibration activations. A stage that declares
``layer_grams`` (``reconstruct``) also gets, for those projection roles, the dense weight and the Gram
matrix of its inputs from this pass (``stats["dense_consumers"]``), taken before any stage changes the layer.
On a model offloaded by ``model.max_memory`` each layer is brought onto the compute device for its turn and written back
afterwards (:func:`slimkit.primitives.offload.resident`), so the device holds one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from slimkit.primitives.calibration import LayerInputs, capture_layer_inputs, input_norm_hooks, run_layer
from slimkit.primitives.offload import resident
from slimkit.primitives.reconstruct.gram import gram_hooks
from slimkit.recipes.context import Context
from slimkit.recipes.registry import stage_def
from slimkit.recipes.schema import StageSpec


@dataclass(frozen=True)
class DenseConsumer:
    """A projection as the block's statistics pass saw it: its dense weight and the Gram of its inputs."""

    weight: torch.Tensor
    gram: torch.Tensor


def run_layerwise(
    ctx: Context,
    stages: list[StageSpec],
    propagate: Literal["dense", "compressed"],
    on_layer: Callable[[int], None] | None = None,
) -> None:
    view = ctx.view
    definitions = [(stage_def(s.stage), s.parsed_args()) for s in stages]
    needs_stats = any(d.needs_calibration(a) for d, a in definitions)
    inputs = capture_layer_inputs(ctx.model, view.layer(0).module, ctx.calibration_batches()) if needs_stats else None
    names = {id(module): name for name, module in ctx.model.named_modules()}
    for layer in view.layers:
        with resident(ctx.model, names[id(layer.module)], layer.module):
            _compress_layer(ctx, definitions, layer.index, inputs, propagate)
        if on_layer is not None:
            on_layer(layer.index)


def _compress_layer(
    ctx: Context,
    definitions: list,
    index: int,
    inputs: LayerInputs | None,
    propagate: Literal["dense", "compressed"],
) -> None:
    """Calibrate layer ``index`` on ``inputs``, run the stages on it, and advance ``inputs`` to its outputs."""
    layer = ctx.view.layer(index)
    stats: dict = {}
    outputs = None
    if inputs is not None:
        modules = ctx.view.linears([layer])
        roles = sorted(frozenset().union(*(d.layer_grams(a) for d, a in definitions)))
        consumers = {role: layer.linear(role) for role in roles}
        with input_norm_hooks(modules) as accumulators, gram_hooks(consumers) as grams:
            outputs = run_layer(layer.module, inputs)
        stats["input_norms"] = {path: acc.norms() for path, acc in accumulators.items()}
        if roles:  # the dense layer's consumers, before any stage of the block changes them
            stats["dense_consumers"] = {
                role: DenseConsumer(module.weight.detach().clone(), grams[role].gram)
                for role, module in consumers.items()
            }
        stats["tokens"] = inputs.tokens
        stats["layer_inputs"] = inputs
    for definition, args in definitions:
        definition.fn(ctx, args, ctx.view.layer(index), stats)
    if inputs is not None:
        if propagate == "compressed":
            outputs = run_layer(ctx.view.layer(index).module, inputs)
        inputs.hidden = outputs
