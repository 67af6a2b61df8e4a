"""How a family stores its routed experts, and the one form slimkit's expert primitives compute on.

The *row form* (:class:`RowExperts`): ``gate`` and ``up`` ``(experts, width, hidden)``, ``down`` ``(experts, hidden,
width)`` and the biases where the family has them. Families store ``rows`` (``gate_up`` ``(experts, 2 x width,
hidden)``, gate rows then up rows: Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3, GLM-4.5), ``columns`` (``(experts, hidden,
2 x width)`` applied as ``x @ W``: Llama 4) or ``interleaved_columns`` (gate at even columns, up at odd ones, with
biases: GPT-OSS). :func:`to_rows` gives views (no copy); :func:`from_rows` stores the row form back exactly.
Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ExpertLayout = Literal["rows", "columns", "interleaved_columns"]


@dataclass(frozen=True)
class RowExperts:
    """One layer's routed experts in the row form."""

    gate: torch.Tensor
    """``(experts, width, hidden)``."""
    up: torch.Tensor
    """``(experts, width, hidden)``."""
    down: torch.Tensor
    """``(experts, hidden, width)``."""
    gate_bias: torch.Tensor | None = None
    """``(experts, width)`` (GPT-OSS)."""
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    """``(experts, hidden)``."""

    @property
    def width(self) -> int:
        return int(self.down.shape[-1])

    @property
    def num_experts(self) -> int:
        return int(self.down.shape[0])

    @property
    def gate_up(self) -> torch.Tensor:
        """``(experts, 2 x width, hidden)``: gate rows, then up rows (a new tensor)."""
        return torch.cat([self.gate, self.up], dim=1)

    @property
    def gate_up_bias(self) -> torch.Tensor | None:
        if self.gate_bias is None or self.up_bias is None:
            return None
        return torch.cat([self.gate_bias, self.up_bias], dim=1)


def to_rows(
    layout: ExpertLayout,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> RowExperts:
    """Views of the stored tensors of ``layout`` in the row form (never changed in place)."""
    if layout == "rows":
        width = down.shape[-1]
        gate, up = gate_up[:, :width], gate_up[:, width:]
        gate_b, up_b = (None, None) if gate_up_bias is None else (gate_up_bias[:, :width], gate_up_bias[:, width:])
        return RowExperts(gate, up, down, gate_b, up_b, down_bias)
    rows = gate_up.transpose(1, 2)
    if layout == "interleaved_columns":
        gate, up = rows[:, 0::2], rows[:, 1::2]
        gate_b, up_b = (None, None) if gate_up_bias is None else (gate_up_bias[:, 0::2], gate_up_bias[:, 1::2])
    else:
        width = down.shape[1]
        gate, up = rows[:, :width], rows[:, width:]
        gate_b, up_b = (None, None) if gate_up_bias is None else (gate_up_bias[:, :width], gate_up_bias[:, width:])
    return RowExperts(gate, up, down.transpose(1, 2), gate_b, up_b, down_bias)


def from_rows(layout: ExpertLayout, experts: RowExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The row form as ``layout`` stores it: ``(gate_up, down, gate_up_bias)``, contiguous (``down_bias`` needs no
    conversion)."""
    bias = experts.gate_up_bias
    if layout == "rows":
        return experts.gate_up.contiguous(), experts.down.contiguous(), bias
    if layout == "interleaved_columns":
        rows = torch.stack([experts.gate, experts.up], dim=2).flatten(1, 2)  # (E, 2I, H): g0, u0, g1, u1, ...
        if experts.gate_bias is not None and experts.up_bias is not None:
            bias = torch.stack([experts.gate_bias, experts.up_bias], dim=2).flatten(1, 2)
    else:
        rows = experts.gate_up
    return rows.transpose(1, 2).contiguous(), experts.down.transpose(1, 2).contiguous(), bias


def stored_width(layout: ExpertLayout, down: torch.Tensor) -> int:
    """One expert's width from the stored ``down`` tensor."""
    return int(down.shape[-1] if layout == "rows" else down.shape[1])


__all__ = ["ExpertLayout", "RowExperts", "from_rows", "stored_width", "to_rows"]
