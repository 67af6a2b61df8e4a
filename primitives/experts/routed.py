"""The routed part of a MoE MLP as a pure function of its tensors, with experts masked out of the routing.

``routed_output(weights, x, keep)`` is what the layer's routed experts add for tokens ``x`` when only the experts in
``keep`` exist: the router's rule over the kept experts (:mod:`slimkit.primitives.experts.routers`: softmax, top-k
logits then softmax, group-limited sigmoid, sigmoid-scaled inputs), each chosen expert's output weighted. An expert
computes ``down(glu(gate x, up x))`` on the row form (:mod:`slimkit.primitives.arch.expert_layout`), with its biases
where the family has them and GPT-OSS's clamped SwiGLU. Masking a dropped expert before the choice is exactly what
removing its router row does, so a kept set can be scored before anything is cut. A shared expert does not depend
on the kept set and is not part of this output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from slimkit.primitives.arch.expert_layout import RowExperts
from slimkit.primitives.arch.moe import MoEBlock
from slimkit.primitives.experts.routers import Router, route


@dataclass(frozen=True)
class Glu:
    """How an expert combines its gate and up: ``act(gate) * up``, or GPT-OSS's clamped SwiGLU."""

    activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    limit: float | None = None
    """GPT-OSS: gate clamped above at ``limit``, up to ``[-limit, limit]``; then ``(up + 1) * g * sigmoid(alpha g)``."""
    alpha: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            assert self.activation is not None
            return self.activation(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's router and routed experts (row form), and how they compute."""

    rule: Router
    experts: RowExperts
    glu: Glu

    @property
    def router(self) -> torch.Tensor:
        """``(experts, hidden)`` router rows."""
        return self.rule.weight

    @property
    def gate_up(self) -> torch.Tensor:
        """``(experts, 2 x width, hidden)``: gate rows, then up rows."""
        return self.experts.gate_up

    @property
    def down(self) -> torch.Tensor:
        """``(experts, hidden, width)``."""
        return self.experts.down

    @property
    def num_experts(self) -> int:
        return self.rule.num_experts

    @property
    def top_k(self) -> int:
        return self.rule.top_k

    @property
    def renormalise(self) -> bool:
        return self.rule.renormalise

    @property
    def activation(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gate's activation (``act`` of ``act(gate) * up``)."""
        assert self.glu.activation is not None
        return self.glu.activation

    def with_router(
        self, rows: torch.Tensor, bias: torch.Tensor | None = None, correction: torch.Tensor | None = None
    ) -> ExpertWeights:
        """A copy with other router rows and per-expert router vectors (a logit ``bias``, a choice ``correction``)."""
        return replace(self, rule=replace(self.rule, weight=rows, bias=bias, correction=correction))

    @classmethod
    def of(cls, block: MoEBlock) -> ExpertWeights:
        experts = block.experts
        if block.spec.expert_glu == "clamped_swiglu":
            glu = Glu(limit=float(experts.limit), alpha=float(experts.alpha))
        else:
            glu = Glu(activation=block.activation)
        return cls(block.router_rule(), block.rows(), glu)


def expert_intermediate(weights: ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``glu(gate x, up x)`` of one expert for tokens ``x`` ``(tokens, hidden)``: ``(tokens, width)``."""
    experts = weights.experts

    def linear(matrix: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(
            x, matrix[expert].to(x.dtype), None if bias is None else bias[expert].to(x.dtype)
        )

    return weights.glu(linear(experts.gate, experts.gate_bias), linear(experts.up, experts.up_bias))


def expert_output(weights: ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's output ``down(glu(gate x, up x))`` for tokens ``x``: ``(tokens, hidden)``."""
    bias = weights.experts.down_bias
    return torch.nn.functional.linear(
        expert_intermediate(weights, expert, x),
        weights.down[expert].to(x.dtype),
        None if bias is None else bias[expert].to(x.dtype),
    )


def routing(
    weights: ExpertWeights, x: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices and their weights ``(tokens, top_k)`` each, float32, with only ``keep`` (a boolean
    mask over the experts; None: all) routable. (Llama 4's input scales: :func:`slimkit.primitives.experts.routers.
    route`.)"""
    chosen = route(weights.rule, x, keep)
    return chosen.index, chosen.weight


def input_scales(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor | None:
    """``(tokens, experts)`` float32: what each expert's input is multiplied by under a ``sigmoid_top`` router (the
    sigmoid of its logit, which no kept set changes), or None for the other rules."""
    if weights.rule.kind != "sigmoid_top":
        return None
    from slimkit.primitives.experts.routers import logits

    return torch.sigmoid(logits(weights.rule, x))


def combine(outputs: torch.Tensor, index: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``sum_j top[t, j] * outputs[index[t, j], t]`` from every expert's output on every token
    ``outputs`` ``(experts, tokens, hidden)``."""
    tokens = torch.arange(index.shape[0], device=index.device)
    chosen = outputs[index, tokens[:, None]]  # (tokens, top_k, hidden)
    return (chosen.float() * top[..., None]).sum(dim=1)


def expert_outputs(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """Every expert's output on every token, ``(experts, tokens, hidden)`` float32 (for scoring many kept sets
    on the same tokens: one gather each); under a ``sigmoid_top`` router each on its scaled input."""
    scales = input_scales(weights, x)
    return torch.stack(
        [
            expert_output(weights, e, x if scales is None else x * scales[:, e, None].to(x.dtype)).float()
            for e in range(weights.num_experts)
        ]
    )


def routed_output(weights: ExpertWeights, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output for tokens ``x`` ``(tokens, hidden)`` with only ``keep`` routable, float32."""
    chosen = route(weights.rule, x, keep)
    index, top = chosen.index, chosen.weight
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in index.unique().tolist():
        token, slot = torch.where(index == expert)
        inputs = x[token]
        if chosen.input_scale is not None:
            inputs = inputs * chosen.input_scale[token, slot, None].to(x.dtype)
        out.index_add_(0, token, expert_output(weights, expert, inputs).float() * top[token, slot, None])
    return out


__all__ = [
    "ExpertWeights",
    "Glu",
    "combine",
    "expert_intermediate",
    "expert_output",
    "expert_outputs",
    "input_scales",
    "routed_output",
    "routing",
]
