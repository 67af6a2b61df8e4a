"""FLAP's global allocation: units of every layer ranked on one scale, landing on a number of parameters removed.

Each group (one layer's units of one kind) has its scores standardised, ``z = (s - mean) / std`` within the group
(FLAP's ``standarlization``, per layer and per module kind, ``lib/prune.py`` ``prune_flap``), so a layer whose
scores are all large and one whose scores are all small compare by how a unit stands among its layer's units.
Every unit with ``z`` at or below one threshold ``t`` is removed; each group's kept count is then rounded to its
alignment multiple and clamped to its minimum (:func:`~slimkit.primitives.select.rules.round_kept`, the same rule the
uniform plan uses), and the parameters those counts remove (each unit weighted by its own parameters, FLAP's
``compression_weight``) grow with ``t``. The threshold is bisected to the count nearest the wanted removal; when
rounding makes the two nearest thresholds jump over the tolerance, one group's count is moved by one allowed step
to land (the closest landing; among equals, the one whose removed units score lowest). No plan within the tolerance:
:class:`~slimkit.primitives.select.plan.TargetOutOfReach` with the nearest removals on either side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slimkit.primitives.evaluate.counting import param_parts
from slimkit.primitives.groups import Group
from slimkit.primitives.select.plan import SelectionRules, TargetOutOfReach, multiple_for, removed_params
from slimkit.primitives.select.rules import min_kept, round_kept


@dataclass(frozen=True)
class UnitCosts:
    """What allocation knows of one group: its units, the parameters one unit removes (of the counted part), the
    multiple its kept count is rounded to and the fewest units it keeps."""

    kind: str
    layer: int | None
    size: int
    unit_params: int
    multiple: int = 1
    minimum: int = 1

    def kept(self, count: float) -> int:
        """``count`` kept units rounded to the multiple, within [minimum, size] (the uniform plan's rule)."""
        return round_kept(count, self.size, self.multiple, self.minimum)

    def allowed(self) -> list[int]:
        """Every kept count the rules allow, ascending (multiples from the floor, and the whole group)."""
        floor = min_kept(self.multiple, self.minimum)
        return sorted({*range(floor, self.size, self.multiple), self.size})

    def removed(self, kept: int) -> int:
        return (self.size - kept) * self.unit_params


def unit_costs(
    model: nn.Module, groups: list[Group], rules: SelectionRules, part: str, max_fraction: float = 1.0
) -> list[UnitCosts]:
    """:class:`UnitCosts` of each group under the selection rules, counting parameters of ``part`` (a recipe target
    name or a ``params_by_part`` count); ``max_fraction``: the largest fraction of its units a group may lose."""
    parts = param_parts(model)
    costs = []
    for group in groups:
        per_unit = removed_params(model, [group], [group.size - 1], part, parts)
        minimum = max(rules.min_keep, math.ceil(group.size * (1.0 - max_fraction) - 1e-9))
        costs.append(UnitCosts(group.kind, group.layer, group.size, per_unit, multiple_for(group, rules), minimum))
    return costs


def standardize(scores: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / std`` of one group's scores in float64 (zeros when they do not vary)."""
    values = scores.detach().double().cpu().flatten()
    if values.numel() < 2:
        return torch.zeros_like(values)
    spread = values.std()
    if not torch.isfinite(spread) or spread == 0:
        return torch.zeros_like(values)
    return (values - values.mean()) / spread


def total_removed(costs: list[UnitCosts], kept: list[int]) -> int:
    return sum(c.removed(k) for c, k in zip(costs, kept, strict=True))


def global_ranking(scores: list[torch.Tensor], costs: list[UnitCosts], wanted: int, tolerance: int) -> list[int]:
    """Kept units per group whose removal, lowest standardised scores first across every group, removes ``wanted``
    parameters within ``tolerance``, each count a multiple of its group's alignment and at least its minimum.

    Raises :class:`TargetOutOfReach` (the nearest removals below and above) when no tried plan lands."""
    ranked = [torch.sort(standardize(s)).values for s in scores]  # ascending: the first ones go first
    thresholds = torch.unique(torch.cat(ranked))  # sorted

    def kept_at(index: int) -> list[int]:  # remove every unit with z <= thresholds[index] (index -1: none)
        if index < 0:
            return [c.kept(c.size) for c in costs]
        t = thresholds[index]
        return [c.kept(c.size - int(torch.searchsorted(z, t, right=True))) for c, z in zip(costs, ranked, strict=True)]

    most = total_removed(costs, [min(c.allowed()) for c in costs])
    if wanted > most + tolerance:
        raise TargetOutOfReach(wanted, tolerance, most, None)
    low, high = -1, len(thresholds) - 1  # removed(low) < wanted <= removed(high), where the range allows
    if total_removed(costs, kept_at(low)) >= wanted:
        high = low
    while high - low > 1:
        middle = (low + high) // 2
        if total_removed(costs, kept_at(middle)) < wanted:
            low = middle
        else:
            high = middle
    candidates = [kept_at(low), kept_at(high)]
    below, above = candidates
    candidates += _one_step(costs, ranked, below, +1) + _one_step(costs, ranked, above, -1)
    landing = [k for k in candidates if abs(total_removed(costs, k) - wanted) <= tolerance]
    if landing:
        return min(landing, key=lambda k: (abs(total_removed(costs, k) - wanted), _removed_score(ranked, costs, k)))
    reached = [total_removed(costs, k) for k in candidates]
    raise TargetOutOfReach(
        wanted,
        tolerance,
        max((r for r in reached if r < wanted), default=None),
        min((r for r in reached if r > wanted), default=None),
    )


def _one_step(costs: list[UnitCosts], ranked: list[torch.Tensor], kept: list[int], direction: int) -> list[list[int]]:
    """Plans that move one group's count by one allowed step: ``+1`` removes more, ``-1`` keeps more."""
    moved = []
    for i, cost in enumerate(costs):
        allowed = cost.allowed()
        position = allowed.index(kept[i]) if kept[i] in allowed else None
        if position is None:
            continue
        step = position - direction
        if 0 <= step < len(allowed):
            moved.append([*kept[:i], allowed[step], *kept[i + 1 :]])
    return moved


def _removed_score(ranked: list[torch.Tensor], costs: list[UnitCosts], kept: list[int]) -> float:
    """Sum of the standardised scores of the removed units (each group removes its lowest), weighted by their
    parameters: the lower, the less important what the plan removes."""
    return sum(float(z[: c.size - k].sum()) * c.unit_params for z, c, k in zip(ranked, costs, kept, strict=True))


__all__ = ["UnitCosts", "global_ranking", "standardize", "total_removed", "unit_costs"]
