"""Importance scorers: ``score(group, layer, stats) -> 1-D tensor`` over the group's units.

Registered by name for recipes (:data:`SCORERS`). Scores of a group sum over its members; within
a member, per-weight scores are aggregated over the unit's row or column with ``aggregation``
(``l1``, ``l2``, ``linf`` or ``mean``).

* ``magnitude``: |W_ij|.
* ``activation`` (Wanda-style): |W_ij| * ||X_j||_2, with ``X_j`` the j-th input feature of that
  projection over all calibration tokens. For a down projection the unit is an input column, so
  every weight of column i shares ||X_i||.
* ``random``: uniform noise from the run's seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from slimkit.primitives.arch import LayerView
from slimkit.primitives.groups import Group

Aggregation = Literal["l1", "l2", "linf", "mean"]
AGGREGATIONS: tuple[str, ...] = ("l1", "l2", "linf", "mean")


def aggregate(weights: torch.Tensor, dim: int, how: Aggregation) -> torch.Tensor:
    """Reduce per-weight scores to one score per unit; units run along ``dim``."""
    other = 1 - dim
    if how == "l1":
        return weights.abs().sum(dim=other)
    if how == "l2":
        return weights.pow(2).sum(dim=other).sqrt()
    if how == "linf":
        return weights.abs().amax(dim=other)
    if how == "mean":
        return weights.abs().mean(dim=other)
    raise ValueError(f"unknown aggregation '{how}'; allowed: {', '.join(AGGREGATIONS)}")


def weight_scores(
    group: Group, layer: LayerView, input_norms: Mapping[str, torch.Tensor] | None, aggregation: Aggregation
) -> torch.Tensor:
    total = torch.zeros(group.size)
    for member in group.members:
        weight = layer.linear(member.role).weight.detach().float().abs()
        if input_norms is not None:
            weight = weight * input_norms[member.role].to(weight)[None, :]
        total += aggregate(weight, member.dim, aggregation)
    return total


def magnitude(group: Group, layer: LayerView, stats: Mapping, aggregation: Aggregation = "l1", **_) -> torch.Tensor:
    return weight_scores(group, layer, None, aggregation)


def activation(group: Group, layer: LayerView, stats: Mapping, aggregation: Aggregation = "l2", **_) -> torch.Tensor:
    return weight_scores(group, layer, stats["input_norms"], aggregation)


def random(group: Group, layer: LayerView, stats: Mapping, generator: torch.Generator | None = None, **_):
    return torch.rand(group.size, generator=generator)


SCORERS: dict[str, Callable[..., torch.Tensor]] = {
    "magnitude": magnitude,
    "activation": activation,
    "random": random,
}
NEEDS_CALIBRATION = {"activation"}
