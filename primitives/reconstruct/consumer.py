"""A consumer projection as a layer's statistics pass saw it before any stage changed it (:class:`DenseConsumer`),
and the paired pass that accumulates the cross term of the dense and the compressed activation streams
(:func:`paired_pass`), which ``reconstruct`` with ``target: dense`` refits against."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from slimkit.primitives.calibration import LayerInputs
from slimkit.primitives.reconstruct.gram import CrossGramAccumulator, GramStatistics, MeanAccumulator


@dataclass(frozen=True)
class DenseConsumer:
    """A projection as the block's statistics pass saw it: its dense weight and the statistics of its inputs.

    ``gram``, ``input_sum`` and ``tokens`` are ``G = Σ x xᵀ``, ``Σ x`` and ``T`` of the inputs the layer receives in
    this block (the compressed predecessors' outputs inside ``sequential``). ``cross`` and ``dense_sum`` are
    ``C = Σ x_d xᵀ`` and ``Σ x_d`` with ``x_d`` the dense model's input (only for a stage's ``dense_targets``);
    ``bias`` is the dense bias (None when the projection has none)."""

    weight: torch.Tensor
    gram: torch.Tensor
    input_sum: torch.Tensor | None = None
    tokens: int = 0
    bias: torch.Tensor | None = None
    cross: torch.Tensor | None = None
    dense_sum: torch.Tensor | None = None


def paired_pass(
    layer_module: torch.nn.Module, consumers: Mapping[str, torch.nn.Module], inputs: LayerInputs, dense: LayerInputs
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Run the (still dense) layer on both streams batch by batch: per role ``(Σ x_d x_cᵀ, Σ x_d)``, and the dense
    stream's outputs (its next inputs)."""
    seen: dict[str, torch.Tensor] = {}
    cross: dict[str, CrossGramAccumulator] = {}
    sums: dict[str, MeanAccumulator] = {}

    def hook(role: str):
        def keep(_module: torch.nn.Module, args: tuple) -> None:
            seen[role] = args[0].detach()

        return keep

    handles = [module.register_forward_pre_hook(hook(role)) for role, module in consumers.items()]
    outputs = []
    try:
        with torch.no_grad():
            for hidden_c, hidden_d, kwargs in zip(inputs.hidden, dense.hidden, inputs.kwargs, strict=True):
                out = layer_module(hidden_d, **kwargs)
                outputs.append(out[0] if isinstance(out, tuple) else out)
                from_dense = dict(seen)
                layer_module(hidden_c, **kwargs)
                for role in consumers:
                    x_d, x_c = from_dense[role], seen[role]
                    if role not in cross:
                        cross[role] = CrossGramAccumulator(x_d.shape[-1], x_c.shape[-1])
                        sums[role] = MeanAccumulator(x_d.shape[-1])
                    cross[role].update(x_d, x_c)
                    sums[role].update(x_d)
    finally:
        for handle in handles:
            handle.remove()
    return {role: (cross[role].cross, sums[role].sum) for role in consumers}, outputs


def dense_consumer(
    module: torch.nn.Module, grams: GramStatistics, paired: tuple[torch.Tensor, torch.Tensor] | None, target: bool
) -> DenseConsumer:
    """The :class:`DenseConsumer` of one role. A dense target without a second stream (top level: the inputs are
    the dense model's) gets ``C = G`` and ``Σ x_d = Σ x``."""
    cross, dense_sum = paired if paired is not None else (None, None)
    if target and paired is None:
        cross, dense_sum = grams.gram, grams.sum
    bias = module.bias.detach().clone() if module.bias is not None else None
    return DenseConsumer(
        module.weight.detach().clone(), grams.gram, grams.sum, grams.tokens, bias, cross=cross, dense_sum=dense_sum
    )


__all__ = ["DenseConsumer", "dense_consumer", "paired_pass"]
