"""Iterative uniform schedules: every group loses the same fraction of its dense width, step by step.

CCE's Algorithm 1 removes, per iteration, one attention head of every layer, r * d_k MLP kernels with
r = im / (heads * d_k), and d_k hidden features. For a model with d_m = heads * d_k that is the same
fraction 1/heads of every width; a schedule here is that rule made general:

* a cumulative fraction phi_t per iteration (``step`` per iteration, the last one shortened so the
  total lands on the target; or ``iterations`` equal steps), and
* after iteration t each group keeps ``round_kept(width0 * (1 - phi_t), width0, multiple, minimum)``
  units of its dense width ``width0`` (:class:`UnitRule`: GQA heads in multiples of the KV groups
  with at least one per group, hidden features at least one head_dim).

The final fraction is solved on exact parameter counts (:func:`solve_uniform_fraction`), which
account for groups that cut the same matrix along both dimensions (heads and MLP channels remove
rows/columns of q, o, gate, up, down whose other dimension hidden features shrink), so the achieved
ratio is the target up to one rounding step. An unreachable target fails before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import param_parts
from slimkit.primitives.groups import Group
from slimkit.primitives.select import round_kept
from slimkit.primitives.select.plan import bisect_fraction


@dataclass(frozen=True)
class UnitRule:
    multiple: int = 1
    minimum: int = 1


def kept_units(width: int, fraction: float, rule: UnitRule) -> int:
    """Units a group of dense width ``width`` keeps after losing ``fraction`` of it."""
    return round_kept(width * (1.0 - fraction), width, rule.multiple, rule.minimum)


def remaining_params(model: nn.Module, removals: Sequence[tuple[Group, int]], part: str = "total") -> int:
    """Parameters of ``part`` left after removing ``n`` units of each group (overlaps counted once)."""
    parts = param_parts(model)
    shapes: dict[int, tuple[nn.Parameter, list[int]]] = {id(p): (p, list(p.shape)) for p in model.parameters()}
    for group, removed in removals:
        for member, tensor in group.distinct_members(model):
            shapes[id(tensor)][1][member.dim] -= removed * member.indices.shape[1]
    total = 0
    for key, (_param, shape) in shapes.items():
        name, in_layers = parts[key]
        if part == "total" or name == part or (part == "layers" and in_layers):
            total += math.prod(shape)
    return total


def _removals(groups: Sequence[Group], rules: Sequence[UnitRule], fraction: float) -> list[tuple[Group, int]]:
    return [(g, g.size - kept_units(g.size, fraction, r)) for g, r in zip(groups, rules, strict=True)]


def solve_uniform_fraction(
    model: nn.Module, groups: Sequence[Group], rules: Sequence[UnitRule], part: str, wanted: int, floors: str = ""
) -> float:
    """The fraction phi whose rounded removals take closest to ``wanted`` parameters of ``part``.

    Raises :class:`SlimkitError` (``floors`` describes the minimums) when even phi = 1 removes fewer.
    """
    before = remaining_params(model, [], part)

    def removed(fraction: float) -> int:
        return before - remaining_params(model, _removals(groups, rules, fraction), part)

    most = removed(1.0)
    if wanted > most:
        raise SlimkitError(
            f"the target needs {wanted:,} parameters of {part} removed ({wanted / before:.1%}), but the schedule "
            f"removes at most {most:,} ({most / before:.1%}){': ' + floors if floors else ''}"
        )
    return bisect_fraction(removed, wanted, steps=40)


def iteration_fractions(final: float, step: float | None = None, iterations: int | None = None) -> list[float]:
    """Cumulative fractions phi_1 < ... < phi_T = ``final``: steps of ``step`` (the last shortened) or
    ``iterations`` equal steps."""
    if final <= 0:
        return []
    if (step is None) == (iterations is None):
        raise ValueError("give exactly one of step and iterations")
    if iterations is not None:
        return [final * t / iterations for t in range(1, iterations + 1)]
    count = max(1, math.ceil(final / step - 1e-9))
    return [min(final, step * t) for t in range(1, count + 1)]


__all__ = ["UnitRule", "iteration_fractions", "kept_units", "remaining_params", "solve_uniform_fraction"]
