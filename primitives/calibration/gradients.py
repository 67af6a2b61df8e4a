"""Gradients of the calibration loss, accumulated per parameter.

For each calibration batch the causal-LM loss (mean next-token cross-entropy) is back-propagated;
per parameter we keep the sum of the batch gradients ``g`` and the sum of their squares ``h``
(the diagonal Fisher approximation of the Hessian that LLM-Pruner's second-order Taylor term uses).
Stored by parameter identity, so tied parameters have one entry. The sums are float32 on each
parameter's device whatever the weights' dtype (a bfloat16 running sum of squares loses the small
terms); batches are moved to the model's input device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from slimkit.primitives.device.moves import math_dtype, to_input_device


@dataclass
class GradientStats:
    grad: dict[int, torch.Tensor]
    grad_sq: dict[int, torch.Tensor]
    batches: int

    def of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.grad[id(tensor)], self.grad_sq[id(tensor)]


def accumulate_gradients(
    model: nn.Module, batches: Iterable[torch.Tensor], progress: Callable[[int], None] | None = None
) -> GradientStats:
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    was_training = model.training
    grad = {id(p): torch.zeros_like(p, dtype=math_dtype(p.dtype)) for p in params}
    grad_sq = {id(p): torch.zeros_like(p, dtype=math_dtype(p.dtype)) for p in params}
    count = 0
    try:
        model.eval()  # no dropout: the scores describe the model as it is used
        for p in params:
            p.requires_grad_(True)
        for batch in batches:
            model.zero_grad(set_to_none=True)
            batch = to_input_device(model, batch)
            loss = model(batch, labels=batch, use_cache=False).loss
            loss.float().backward()
            for p in params:
                if p.grad is not None:
                    g = p.grad.to(grad[id(p)].dtype)
                    grad[id(p)] += g
                    grad_sq[id(p)] += g * g
            count += 1
            if progress is not None:
                progress(1)
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
    return GradientStats(grad, grad_sq, count)
