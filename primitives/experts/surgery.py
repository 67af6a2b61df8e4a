"""Removing whole routed experts: the router's rows and the fused experts' slices, with top-k kept valid.

:func:`kept_weights` is the pure function on tensors; :func:`keep_experts` applies it to a layer's
:class:`~slimkit.primitives.arch.moe.MoEBlock` and syncs the run-time expert counts. A layer keeps at least its
top-k experts (the router picks top-k distinct experts per token); fewer is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slimkit.primitives.arch.moe import MoEBlock
from slimkit.primitives.errors import SlimkitError


def check_kept(kept: Sequence[int], num_experts: int, top_k: int, where: str) -> list[int]:
    """``kept`` sorted, or one line: out of range, repeated, or fewer experts than the router's top-k."""
    order = sorted(int(e) for e in kept)
    if len(set(order)) != len(order) or any(e < 0 or e >= num_experts for e in order):
        raise SlimkitError(f"{where}: kept experts {order} must be distinct indices in 0-{num_experts - 1}")
    if len(order) < top_k:
        raise SlimkitError(
            f"{where}: {len(order)} experts would remain, fewer than the {top_k} the router picks per token "
            f"(num_experts_per_tok); keep at least {top_k}"
        )
    return order


def kept_weights(
    router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, kept: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router rows and the fused expert slices of the ``kept`` experts (in the order given)."""
    index = torch.as_tensor(list(kept), dtype=torch.long, device=router.device)
    return router[index].clone(), gate_up[index.to(gate_up.device)].clone(), down[index.to(down.device)].clone()


def keep_experts(block: MoEBlock, kept: Sequence[int]) -> list[int]:
    """Keep only the ``kept`` experts of ``block`` (sorted); returns them. The layer's output for a token whose
    top-k stays inside ``kept`` is unchanged."""
    order = check_kept(kept, block.num_experts, block.top_k, f"layer {block.index}")
    router, gate_up, down = kept_weights(
        block.router.weight.data, block.experts.gate_up_proj.data, block.experts.down_proj.data, order
    )
    block.router.weight = nn.Parameter(router, requires_grad=block.router.weight.requires_grad)
    block.experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=block.experts.gate_up_proj.requires_grad)
    block.experts.down_proj = nn.Parameter(down, requires_grad=block.experts.down_proj.requires_grad)
    block.sync_counts()
    return order


__all__ = ["check_kept", "keep_experts", "kept_weights"]
