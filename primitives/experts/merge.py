"""Merging dropped experts into kept ones (MC-SMoE, Li et al. 2024; HC-SMoE, Chen et al. 2024), with a router refit.

Each dropped expert joins the kept expert whose output on the calibration tokens is most alike (cosine similarity of
the two experts' outputs over the sampled router inputs, HC-SMoE's expert-output similarity; the router rows'
cosine when no tokens are given). A kept expert's new weights are its cluster's weights averaged with each member's
routing mass as its weight (MC-SMoE's frequency-weighted merge, ``gate_up`` and ``down`` alike; no neuron
permutation alignment). The router is refit on the same tokens: a cluster's new logit should be the log-sum-exp of
its members' logits, so its softmax probability is the sum of theirs; each kept row is the damped least-squares fit
``argmin_r ||X r - lse(X R_cluster^T)||^2`` over the tokens ``X``. A cluster of one keeps its row exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from slimkit.primitives.arch.expert_layout import RowExperts
from slimkit.primitives.arch.moe import MoEBlock
from slimkit.primitives.experts.routed import ExpertWeights, expert_outputs


@dataclass(frozen=True)
class MergePlan:
    kept: list[int]
    clusters: dict[int, list[int]]
    """Kept expert -> its cluster (itself first, then the dropped experts merged into it)."""


def assign_dropped(weights: ExpertWeights, kept: Sequence[int], x: torch.Tensor | None) -> MergePlan:
    """Each dropped expert to its most similar kept expert (by output on ``x``, else by router row)."""
    kept = sorted(kept)
    if x is not None and x.numel():
        features = expert_outputs(weights, x).flatten(1)
    else:
        features = weights.router.float()
    features = nn.functional.normalize(features.double(), dim=1)
    similarity = features @ features[kept].T  # (experts, kept)
    clusters = {k: [k] for k in kept}
    for expert in range(weights.num_experts):
        if expert not in clusters:
            clusters[kept[int(similarity[expert].argmax())]].append(expert)
    return MergePlan(kept, clusters)


def merged_weights(
    weights: ExpertWeights, plan: MergePlan, mass: torch.Tensor, x: torch.Tensor | None, damp: float = 1e-6
) -> ExpertWeights:
    """The kept experts' mass-weighted averages (biases too), and the router refit on ``x`` (kept rows unchanged
    without ``x``, and under a router whose rule is not a softmax over the logits: a log-sum-exp target has no
    meaning there)."""
    experts = weights.experts

    def average(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        rows = []
        for k in plan.kept:
            members = plan.clusters[k]
            m = mass[members].double().clamp_min(0)
            share = m / m.sum() if float(m.sum()) > 0 else torch.eye(len(members), dtype=torch.float64)[0]
            rows.append(torch.einsum("m,m...->...", share.to(tensor.device), tensor[members].double()))
        return torch.stack(rows).to(tensor.dtype)

    merged = RowExperts(
        average(experts.gate),  # type: ignore[arg-type]
        average(experts.up),  # type: ignore[arg-type]
        average(experts.down),  # type: ignore[arg-type]
        average(experts.gate_bias),
        average(experts.up_bias),
        average(experts.down_bias),
    )
    router_rows = weights.router[plan.kept].double()
    if x is not None and x.numel() and weights.rule.kind == "softmax":
        inputs = x.double()
        logits = inputs @ weights.router.double().T
        targets = torch.stack([torch.logsumexp(logits[:, plan.clusters[k]], dim=1) for k in plan.kept], dim=1)
        gram = inputs.T @ inputs
        ridge = damp * gram.diagonal().mean().clamp_min(1e-12)
        gram += ridge * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        router_rows = torch.linalg.solve(gram, inputs.T @ targets).T
        singles = [i for i, k in enumerate(plan.kept) if len(plan.clusters[k]) == 1]
        router_rows[singles] = weights.router[[plan.kept[i] for i in singles]].double()
    bias, correction = (None if v is None else v[plan.kept] for v in (weights.rule.bias, weights.rule.correction))
    return replace(weights.with_router(router_rows.to(weights.router.dtype), bias, correction), experts=merged)


def set_expert_weights(block: MoEBlock, weights: ExpertWeights) -> None:
    """Put ``weights`` (router rows and vectors, routed experts, any count) into ``block`` and sync its counts."""
    vectors = {"bias": weights.rule.bias, "e_score_correction_bias": weights.rule.correction}
    like = block.router.weight
    block.router.weight = nn.Parameter(weights.router.to(like.device, like.dtype), requires_grad=like.requires_grad)
    for name in block.spec.router_vectors:
        old, value = getattr(block.router, name), vectors[name]
        assert value is not None
        value = value.to(old.device, old.dtype)
        if name in block.router._parameters:
            setattr(block.router, name, nn.Parameter(value, requires_grad=old.requires_grad))
        else:
            setattr(block.router, name, value)
    block.set_rows(weights.experts)
    block.sync_counts()


__all__ = ["MergePlan", "assign_dropped", "merged_weights", "set_expert_weights"]
