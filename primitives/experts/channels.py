"""Channels inside routed experts (the ``expert_channel`` unit): scoring and removing intermediate channels.

A layer's fused experts hold one width for all experts, so a layer keeps the same number of channels in every
expert. ``shared``: the same channel indices in every expert (as Minitron prunes a MoE layer's ``moe_ffn_hidden_size``
homogeneously in NVIDIA Model-Optimizer); otherwise each expert keeps its own best channels.

Scores are Wanda's (Sun et al. 2024) read per channel: the norm of the channel's column of ``down`` times the norm of
the channel's activation ``act(gate x) * up x`` over only the tokens routed to that expert
(:attr:`slimkit.primitives.calibration.routing.ExpertRouting.channel_sq`). A shared score sums each expert's scores.
Removing a channel drops its gate row, its up row and its down column; a channel whose down column is zero adds
nothing, so removing it leaves the layer unchanged. transformers' grouped expert matmul (its default experts
implementation) needs each row of the fused tensors to be a multiple of 16 bytes, so kept widths are multiples of 8
(:data:`WIDTH_MULTIPLE`) wherever the stage chooses them.
"""

from __future__ import annotations

import torch

from slimkit.primitives.arch.expert_layout import RowExperts
from slimkit.primitives.arch.moe import MoEBlock

WIDTH_MULTIPLE = 8
"""Kept expert widths are multiples of this: 16-byte rows in bfloat16 (transformers' grouped_mm needs them)."""


def channel_scores(down: torch.Tensor, channel_sq: torch.Tensor) -> torch.Tensor:
    """``(experts, width)`` Wanda scores: ``||down[e][:, c]|| * sqrt(sum over routed tokens of a_c^2)``."""
    return down.double().norm(dim=1) * channel_sq.double().clamp_min(0).sqrt().to(down.device)


def kept_channels(scores: torch.Tensor, keep: int, shared: bool) -> torch.Tensor:
    """``(experts, keep)`` sorted channel indices each expert keeps (the same row for every expert when shared)."""
    if shared:
        total = scores.sum(dim=0)
        order = sorted(range(total.numel()), key=lambda c: (-float(total[c]), c))[:keep]
        return torch.tensor(sorted(order), dtype=torch.long).expand(scores.shape[0], keep).clone()
    top = torch.topk(scores, keep, dim=1).indices
    return top.sort(dim=1).values.cpu()


def slice_channels(gate_up: torch.Tensor, down: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused tensors keeping channels ``index`` ``(experts, keep)`` of each expert: gate rows, up rows
    (``width`` further on) and down columns."""
    width = down.shape[-1]
    index = index.to(gate_up.device)
    rows = torch.cat([index, index + width], dim=1)  # (experts, 2 x keep)
    new_gate_up = torch.gather(gate_up, 1, rows[:, :, None].expand(-1, -1, gate_up.shape[-1]))
    new_down = torch.gather(down, 2, index.to(down.device)[:, None, :].expand(-1, down.shape[1], -1))
    return new_gate_up.clone(), new_down.clone()


def keep_expert_channels(block: MoEBlock, index: torch.Tensor) -> None:
    """Keep channels ``index`` ``(experts, keep)`` of every routed expert of ``block`` (their gate and up biases
    too, where the family has them)."""
    if index.shape[0] != block.num_experts or index.shape[1] < 1:
        raise ValueError(f"layer {block.index}: need (experts, keep >= 1) channel indices, got {tuple(index.shape)}")
    rows = block.rows()
    at = index.to(rows.down.device)

    def keep_rows(tensor: torch.Tensor | None) -> torch.Tensor | None:  # (E, width, ...) -> (E, keep, ...)
        if tensor is None:
            return None
        gather = at.reshape(*at.shape, *([1] * (tensor.dim() - 2))).expand(-1, -1, *tensor.shape[2:])
        return torch.gather(tensor, 1, gather.to(tensor.device)).clone()

    down = torch.gather(rows.down, 2, at[:, None, :].expand(-1, rows.down.shape[1], -1)).clone()
    block.set_rows(
        RowExperts(
            keep_rows(rows.gate),  # type: ignore[arg-type]
            keep_rows(rows.up),  # type: ignore[arg-type]
            down,
            keep_rows(rows.gate_bias),
            keep_rows(rows.up_bias),
            rows.down_bias,
        )
    )
    for name in ("intermediate_dim", "intermediate_size", "expert_dim"):  # widths the experts keep as attributes
        if isinstance(getattr(block.experts, name, None), int):
            setattr(block.experts, name, int(index.shape[1]))


__all__ = ["WIDTH_MULTIPLE", "channel_scores", "keep_expert_channels", "kept_channels", "slice_channels"]
