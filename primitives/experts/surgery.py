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
from slimkit.primitives.experts.routers import check_groups


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
    top-k stays inside ``kept`` is unchanged. Every expert tensor (biases included) and the router's rows and
    per-expert vectors are sliced; a group-limited router must keep the same number in every group."""
    order = check_kept(kept, block.num_experts, block.top_k, f"layer {block.index}")
    reason = check_groups(block.router_rule(), order)
    if reason is not None:
        raise SlimkitError(f"layer {block.index}: {reason}")
    index = torch.as_tensor(order, dtype=torch.long)
    named = [(block.router, "weight"), *((block.router, name) for name in block.spec.router_vectors)]
    named += [(block.experts, name) for name, _ in block.experts.named_parameters(recurse=False)]
    for module, name in named:
        tensor = getattr(module, name)
        sliced = tensor.detach()[index.to(tensor.device)].clone()
        if name in module._parameters:
            setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
        else:  # a buffer (the router's choice correction)
            setattr(module, name, sliced)
    block.sync_counts()
    return order


__all__ = ["check_kept", "keep_experts", "kept_weights"]
