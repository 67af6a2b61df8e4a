"""How a family stores its routed experts, and the one form slimkit's expert primitives compute on.

The *row form*: ``gate_up`` ``(experts, 2 x width, hidden)`` (every gate row, then every up row), ``down``
``(experts, hidden, width)``, and where the family has them the biases ``gate_up_bias`` ``(experts, 2 x width)`` and
``down_bias`` ``(experts, hidden)``. Families store them as:

* ``rows``: the row form itself (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3, GLM-4.5 in transformers 5);
* ``columns``: ``gate_up`` ``(experts, hidden, 2 x width)`` (gate columns, then up), ``down`` ``(experts, width,
  hidden)``, applied as ``x @ W`` (Llama 4);
* ``interleaved_columns``: as ``columns`` with gate and up interleaved, gate at even columns and up at odd ones, and
  biases (GPT-OSS).

:func:`to_rows` and :func:`from_rows` convert exactly (only transposes and index permutations). Method note:
docs/methods/moe-experts.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ExpertLayout = Literal["rows", "columns", "interleaved_columns"]


@dataclass(frozen=True)
class RowExperts:
    """One layer's routed experts in the row form."""

    gate_up: torch.Tensor
    """``(experts, 2 x width, hidden)``: gate rows, then up rows."""
    down: torch.Tensor
    """``(experts, hidden, width)``."""
    gate_up_bias: torch.Tensor | None = None
    """``(experts, 2 x width)``: gate biases, then up biases (GPT-OSS)."""
    down_bias: torch.Tensor | None = None
    """``(experts, hidden)``."""

    @property
    def width(self) -> int:
        return int(self.down.shape[-1])

    @property
    def num_experts(self) -> int:
        return int(self.down.shape[0])


def _odd(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    index = torch.arange(1, tensor.shape[dim], 2, device=tensor.device)
    return tensor.index_select(dim, index)


def _even(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    index = torch.arange(0, tensor.shape[dim], 2, device=tensor.device)
    return tensor.index_select(dim, index)


def _interleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of de-interleaving: ``[g0, g1, u0, u1]`` -> ``[g0, u0, g1, u1]`` along ``dim``."""
    gate, up = tensor.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def to_rows(
    layout: ExpertLayout,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> RowExperts:
    """The stored tensors of ``layout`` in the row form (views or copies; never changed in place)."""
    if layout == "rows":
        return RowExperts(gate_up, down, gate_up_bias, down_bias)
    rows = gate_up.transpose(1, 2)
    bias = gate_up_bias
    if layout == "interleaved_columns":
        rows = torch.cat([_even(rows, 1), _odd(rows, 1)], dim=1)
        bias = None if bias is None else torch.cat([_even(bias, 1), _odd(bias, 1)], dim=1)
    return RowExperts(rows, down.transpose(1, 2), bias, down_bias)


def from_rows(layout: ExpertLayout, experts: RowExperts) -> RowExperts:
    """The row form back in ``layout``'s storage (fields hold the stored tensors: ``gate_up`` as the family keeps
    it), contiguous."""
    if layout == "rows":
        return experts
    gate_up, bias = experts.gate_up, experts.gate_up_bias
    if layout == "interleaved_columns":
        gate_up = _interleave(gate_up, 1)
        bias = None if bias is None else _interleave(bias, 1)
    return RowExperts(
        gate_up.transpose(1, 2).contiguous(),
        experts.down.transpose(1, 2).contiguous(),
        None if bias is None else bias.contiguous(),
        experts.down_bias,
    )


def stored_width(layout: ExpertLayout, down: torch.Tensor) -> int:
    """One expert's width from the stored ``down`` tensor."""
    return int(down.shape[-1] if layout == "rows" else down.shape[1])


__all__ = ["ExpertLayout", "RowExperts", "from_rows", "stored_width", "to_rows"]
