"""Slicing one ``nn.Linear``: keep given output rows and/or input columns (bias follows outputs)."""

from __future__ import annotations

import torch
from torch import nn


def slice_linear(
    linear: nn.Linear, keep_out: torch.Tensor | None = None, keep_in: torch.Tensor | None = None
) -> nn.Linear:
    """A new Linear holding ``linear.weight[keep_out][:, keep_in]`` (and ``bias[keep_out]``)."""
    weight = linear.weight.detach()
    bias = linear.bias.detach() if linear.bias is not None else None
    if keep_out is not None:
        keep_out = keep_out.to(device=weight.device, dtype=torch.long)
        weight = weight.index_select(0, keep_out)
        bias = bias.index_select(0, keep_out) if bias is not None else None
    if keep_in is not None:
        weight = weight.index_select(1, keep_in.to(device=weight.device, dtype=torch.long))
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    new.train(linear.training)
    return new
