"""How a mixture-of-experts router picks and weighs experts, as pure functions of its tensors, with experts masked out.

Four rules (:attr:`~slimkit.primitives.arch.moe.MoESpec.router_kind`): ``softmax`` (Mixtral, Qwen-MoE, OLMoE),
``topk_softmax`` (GPT-OSS: the top-k logits, then a softmax over them), ``sigmoid_grouped`` (DeepSeek-V3, Kimi K2,
GLM-4.5: sigmoid scores, a corrected, group-limited choice, scaled weights) and ``sigmoid_top`` (Llama 4: each chosen
expert reads its input times the sigmoid of its logit). A dropped expert is masked before the choice, which is exactly
what removing its router row does (under ``sigmoid_grouped`` when every group keeps the same number:
:func:`check_groups`). Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

RouterKind = Literal["softmax", "topk_softmax", "sigmoid_grouped", "sigmoid_top"]
GROUP_SCORE_EXPERTS = 2
"""A group's score under ``sigmoid_grouped`` is the sum of its best two experts' choice scores."""


@dataclass(frozen=True)
class Router:
    """One layer's router tensors and rule."""

    weight: torch.Tensor
    """``(experts, hidden)``."""
    kind: RouterKind
    top_k: int
    renormalise: bool = True
    bias: torch.Tensor | None = None
    """``(experts,)`` added to the logits (GPT-OSS)."""
    correction: torch.Tensor | None = None
    """``(experts,)`` added to the sigmoid scores for the choice only (``e_score_correction_bias``)."""
    scale: float = 1.0
    """``routed_scaling_factor``: multiplies the chosen weights (``sigmoid_grouped``)."""
    groups: int = 1
    top_groups: int = 1

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and how their outputs are added."""

    index: torch.Tensor
    """``(tokens, top_k)`` expert indices."""
    weight: torch.Tensor
    """``(tokens, top_k)`` float32: what each chosen expert's output is multiplied by."""
    input_scale: torch.Tensor | None = None
    """``(tokens, top_k)`` float32: what each chosen expert's input is multiplied by first (``sigmoid_top``)."""


def logits(router: Router, x: torch.Tensor) -> torch.Tensor:
    """``(tokens, experts)`` float32 router logits for tokens ``x`` ``(tokens, hidden)``."""
    out = torch.nn.functional.linear(x.float(), router.weight.float())
    return out if router.bias is None else out + router.bias.float()


def probabilities(router: Router, x: torch.Tensor) -> torch.Tensor:
    """``(tokens, experts)``: the router's per-expert probability (softmax) or score (sigmoid) before any choice."""
    values = logits(router, x)
    return torch.sigmoid(values) if router.kind in ("sigmoid_grouped", "sigmoid_top") else torch.softmax(values, -1)


def _masked(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return values if keep is None else values.masked_fill(~keep.to(values.device), float("-inf"))


def route(router: Router, x: torch.Tensor, keep: torch.Tensor | None = None) -> Routing:
    """The experts each token of ``x`` ``(tokens, hidden)`` picks with only ``keep`` (a boolean mask over the experts;
    None: all) routable, and their weights."""
    values = logits(router, x)
    if router.kind == "softmax":
        probs = torch.softmax(_masked(values, keep), dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(index, top)
    if router.kind == "topk_softmax":
        top, index = torch.topk(_masked(values, keep), router.top_k, dim=-1)
        return Routing(index, torch.softmax(top, dim=-1))
    if router.kind == "sigmoid_top":
        top, index = torch.topk(_masked(values, keep), router.top_k, dim=-1)
        return Routing(index, torch.ones_like(top), torch.sigmoid(top))
    scores = torch.sigmoid(values)
    choice = scores if router.correction is None else scores + router.correction.float()
    choice = _masked(choice, keep)
    if router.groups > 1:
        tokens = choice.shape[0]
        grouped = choice.view(tokens, router.groups, -1)
        group_scores = grouped.topk(GROUP_SCORE_EXPERTS, dim=-1).values.sum(dim=-1)
        chosen = torch.topk(group_scores, router.top_groups, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        choice = choice.masked_fill(~allowed[:, :, None].expand_as(grouped).reshape(tokens, -1), float("-inf"))
    index = torch.topk(choice, router.top_k, dim=-1).indices
    weight = scores.gather(1, index)
    if router.renormalise:
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(index, weight * router.scale)


def check_groups(router: Router, kept: list[int]) -> str | None:
    """Why ``kept`` experts cannot be all a ``sigmoid_grouped`` router keeps (one phrase), or None: the router splits
    its experts into ``groups`` equal groups in order, so every group must keep the same number, at least the two a
    group's score reads."""
    if router.groups <= 1:
        return None
    size = router.num_experts // router.groups
    per_group = [sum(1 for e in kept if e // size == g) for g in range(router.groups)]
    if len(set(per_group)) > 1 or per_group[0] < GROUP_SCORE_EXPERTS:
        return (
            f"the router picks among {router.groups} groups of {size} experts (n_group), so every group must keep "
            f"the same number of experts, at least {GROUP_SCORE_EXPERTS}; these keep {per_group}"
        )
    return None


def balanced_keep_top(scores: torch.Tensor, keep: int, groups: int) -> list[int]:
    """The ``keep`` highest-scoring experts, ``keep / groups`` in each of ``groups`` equal groups (ties: the lower
    index), sorted."""
    size = scores.numel() // groups
    per_group = keep // groups
    kept: list[int] = []
    for group in range(groups):
        members = range(group * size, (group + 1) * size)
        kept += sorted(members, key=lambda e: (-float(scores[e]), e))[:per_group]
    return sorted(kept)


__all__ = [
    "GROUP_SCORE_EXPERTS",
    "Router",
    "RouterKind",
    "Routing",
    "balanced_keep_top",
    "check_groups",
    "logits",
    "probabilities",
    "route",
]
