"""The routed part of a MoE MLP as a pure function of its tensors, with experts masked out of the routing.

``routed_output(weights, x, keep)`` is what the layer's routed experts add for tokens ``x`` when only the experts in
``keep`` exist: the router's softmax over the kept experts, their top-k, the top-k weights renormalised where the
family does it, each chosen expert's ``down(act(gate x) * up x)`` weighted. Masking a dropped expert's logit to
minus infinity is exactly what removing its router row does, so a kept set can be scored before anything is cut.
The shared expert of Qwen2-MoE does not depend on the kept set and is not part of this output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimkit.primitives.arch.moe import MoEBlock


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's router and fused experts, and how it routes."""

    router: torch.Tensor
    """``(experts, hidden)``."""
    gate_up: torch.Tensor
    """``(experts, 2 x width, hidden)``: gate rows, then up rows."""
    down: torch.Tensor
    """``(experts, hidden, width)``."""
    activation: Callable[[torch.Tensor], torch.Tensor]
    top_k: int
    renormalise: bool

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0])

    @classmethod
    def of(cls, block: MoEBlock) -> ExpertWeights:
        return cls(
            block.router.weight.detach(),
            block.experts.gate_up_proj.detach(),
            block.experts.down_proj.detach(),
            block.activation,
            block.top_k,
            block.renormalises,
        )


def expert_intermediate(weights: ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``act(gate x) * up x`` of one expert for tokens ``x`` ``(tokens, hidden)``: ``(tokens, width)``."""
    gate, up = torch.nn.functional.linear(x, weights.gate_up[expert].to(x.dtype)).chunk(2, dim=-1)
    return weights.activation(gate) * up


def expert_output(weights: ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's output ``down(act(gate x) * up x)`` for tokens ``x``: ``(tokens, hidden)``."""
    return torch.nn.functional.linear(expert_intermediate(weights, expert, x), weights.down[expert].to(x.dtype))


def routing(
    weights: ExpertWeights, x: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices and their weights ``(tokens, top_k)`` each, float32, with only ``keep`` (a boolean
    mask over the experts; None: all) routable."""
    logits = torch.nn.functional.linear(x, weights.router.to(x.dtype)).float()
    if keep is not None:
        logits = logits.masked_fill(~keep.to(logits.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, weights.top_k, dim=-1)
    if weights.renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return index, top


def combine(outputs: torch.Tensor, index: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``sum_j top[t, j] * outputs[index[t, j], t]`` from every expert's output on every token
    ``outputs`` ``(experts, tokens, hidden)``."""
    tokens = torch.arange(index.shape[0], device=index.device)
    chosen = outputs[index, tokens[:, None]]  # (tokens, top_k, hidden)
    return (chosen.float() * top[..., None]).sum(dim=1)


def expert_outputs(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """Every expert's output on every token, ``(experts, tokens, hidden)`` float32 (for scoring many kept sets
    on the same tokens: one gather each)."""
    return torch.stack([expert_output(weights, e, x).float() for e in range(weights.num_experts)])


def routed_output(weights: ExpertWeights, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output for tokens ``x`` ``(tokens, hidden)`` with only ``keep`` routable, float32."""
    index, top = routing(weights, x, keep)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in index.unique().tolist():
        token, slot = torch.where(index == expert)
        out.index_add_(0, token, expert_output(weights, expert, x[token]).float() * top[token, slot, None])
    return out


__all__ = [
    "ExpertWeights",
    "combine",
    "expert_intermediate",
    "expert_output",
    "expert_outputs",
    "routed_output",
    "routing",
]
