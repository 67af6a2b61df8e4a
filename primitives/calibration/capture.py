"""Hook-based capture of activation statistics and of layer inputs.

* :class:`InputNormAccumulator`: streaming per-input-feature sum of squares of a Linear's input,
  so ``norms()`` is ``||X_j||_2`` over all calibration tokens (the Wanda/LoRAP statistic).
* :func:`capture_layer_inputs`: run the model up to layer 0 and keep its inputs (hidden states and
  the keyword arguments the model passes every layer: masks, position embeddings), so layers can
  then be executed one at a time (see :mod:`.sequential`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slimkit.primitives.device.moves import to_input_device


class InputNormAccumulator:
    """Accumulates ``sum_t x_tj^2`` over tokens for every input feature ``j`` of a module.

    The sum is float32 on the activations' device whatever their dtype (bfloat16 squares lose digits)."""

    def __init__(self) -> None:
        self.sum_sq: torch.Tensor | None = None
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        sq = (x * x).sum(dim=0)
        self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        self.tokens += x.shape[0]

    def norms(self) -> torch.Tensor:
        if self.sum_sq is None:
            raise RuntimeError("no activations were captured")
        return self.sum_sq.sqrt()


@contextmanager
def input_norm_hooks(modules: dict[str, nn.Module]):
    """Attach an :class:`InputNormAccumulator` to each module's input while the block runs."""
    accumulators = {name: InputNormAccumulator() for name in modules}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, acc=accumulators[name]: acc.update(args[0]))
        for name, module in modules.items()
    ]
    try:
        yield accumulators
    finally:
        for handle in handles:
            handle.remove()


class _StopForward(Exception):
    pass


@dataclass
class LayerInputs:
    """Inputs of one layer for every calibration batch, plus the shared keyword arguments."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


def capture_layer_inputs(model: nn.Module, first_layer: nn.Module, batches: Iterable[torch.Tensor]) -> LayerInputs:
    """Inputs to ``first_layer`` for each batch (moved to the model's input device); the rest of the model
    is not run. The captured hidden states keep the model's dtype and device."""
    hidden: list[torch.Tensor] = []
    kwargs_list: list[dict[str, Any]] = []

    def catch(_module, args, kwargs):
        hidden.append(args[0].detach() if args else kwargs.pop("hidden_states").detach())
        kwargs_list.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _StopForward

    handle = first_layer.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(to_input_device(model, batch), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs_list)


def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """Outputs of ``layer`` for each captured batch (no grad)."""
    outputs = []
    with torch.no_grad():
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
            out = layer(hidden, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs
