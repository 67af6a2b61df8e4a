"""A pruning plan: from scored groups and a budget to the kept units of every group.

Method note: docs/methods/selection.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import PARTS, param_parts
from slimkit.primitives.groups import Group
from slimkit.primitives.select.rules import (
    global_keep,
    keep_top,
    keep_top_per_block,
    min_kept,
    protect_lowest,
    round_kept,
)

Fraction = float | dict[str, float]
"""A removal fraction: one shared by every group, or one per group kind (see :func:`solve_target`)."""

TARGET_PARTS: dict[str, str] = {"model": "total", "layers": "layers", "mlp": "mlp", "attention": "attention"}
"""Recipe target names (``target.of``) and the parameter count each one is a ratio of."""
COUNT_PARTS: tuple[str, ...] = ("total", "layers", *PARTS)
"""The parameter counts of :func:`~slimkit.primitives.evaluate.counting.params_by_part`."""
PART_NAMES: tuple[str, ...] = tuple(dict.fromkeys((*TARGET_PARTS, *COUNT_PARTS)))
"""Every name :func:`solve_fraction` accepts for ``part``."""


def count_part(part: str) -> str:
    """The ``params_by_part`` count a part name means (``model`` -> ``total``); unknown names fail."""
    if part in TARGET_PARTS:
        return TARGET_PARTS[part]
    if part in COUNT_PARTS:
        return part
    raise SlimkitError(
        f"unknown part {part!r} to count removed parameters of; allowed: recipe targets "
        f"{', '.join(TARGET_PARTS)} or parameter counts {', '.join(COUNT_PARTS)}"
    )


@dataclass(frozen=True)
class SelectionRules:
    """How scores become kept units.

    ``mode``: ``uniform`` (every group loses the same fraction) or ``global`` (one threshold per
    group kind across layers). ``round_to``: kept units of a kind rounded to a multiple (e.g.
    ``{"attention_head": 2}``; GQA head groups are also rounded to their KV-group count).
    ``min_keep``: the fewest units any group keeps. ``protect_lowest``: LoRAP's retained fraction
    of least important units (Eq. 11).
    """

    mode: str = "uniform"
    round_to: dict[str, int] = field(default_factory=dict)
    min_keep: int = 1
    protect_lowest: float = 0.0


def _where(group: Group) -> str:
    return f"layer {group.layer} {group.kind}" if group.layer is not None else group.kind


def fraction_of(fraction: Fraction, kind: str) -> float:
    """The removal fraction of one group kind (the shared one, or the kind's own)."""
    return fraction[kind] if isinstance(fraction, dict) else fraction


def describe(fraction: Fraction) -> str:
    if isinstance(fraction, dict):
        return ", ".join(f"{kind} {value:.1%}" for kind, value in fraction.items())
    return f"{fraction:.1%}"


def multiple_for(group: Group, rules: SelectionRules) -> int:
    multiple = rules.round_to.get(group.kind, 1)
    blocks = group.extra.get("kv_groups", 1)
    return multiple * blocks // math.gcd(multiple, blocks)


def kept_counts(
    groups: list[Group], scores: list[torch.Tensor], fraction: Fraction, rules: SelectionRules
) -> list[int]:
    """Kept units per group for removing ``fraction`` (shared, or per kind) of its units (uniform) or of
    each kind's pooled units (global), rounded to the group's multiple and clamped to the rules' minimum
    and the group size.
    """
    raw: list[float] = [g.size * (1.0 - fraction_of(fraction, g.kind)) for g in groups]
    if rules.mode == "global":  # one threshold per kind: scores of different kinds do not compare
        for kind in dict.fromkeys(g.kind for g in groups):
            members = [i for i, g in enumerate(groups) if g.kind == kind]
            counts = global_keep([scores[i] for i in members], fraction_of(fraction, kind), rules.min_keep)
            for i, count in zip(members, counts, strict=True):
                raw[i] = count
    return [
        round_kept(count, g.size, multiple_for(g, rules), rules.min_keep) for g, count in zip(groups, raw, strict=True)
    ]


def check_shapes(groups: list[Group], rules: SelectionRules) -> None:
    """Raise :class:`SlimkitError` (naming the layer and kind) when a group's shape cannot meet the
    rounding and minimum rules, whatever the budget (e.g. 2 KV groups rounded to a multiple of 4)."""
    for group in groups:
        multiple = multiple_for(group, rules)
        if multiple > group.size:
            raise SlimkitError(f"{_where(group)}: cannot round {group.size} units to a multiple of {multiple}")
        floor = min_kept(multiple, rules.min_keep)
        if floor > group.size:
            raise SlimkitError(
                f"{_where(group)}: keeping at least {rules.min_keep} unit(s) in multiples of {multiple} "
                f"needs {floor}, but the group has {group.size}"
            )


def validate_counts(groups: list[Group], counts: list[int], fraction: Fraction, rules: SelectionRules) -> None:
    check_shapes(groups, rules)
    for group, count in zip(groups, counts, strict=True):
        multiple = multiple_for(group, rules)
        floor = min_kept(multiple, rules.min_keep)
        removing = fraction_of(fraction, group.kind)
        wanted = group.size * (1.0 - removing) if rules.mode == "uniform" else count
        if round(wanted / multiple) * multiple < floor:
            raise SlimkitError(
                f"{_where(group)}: removing {removing:.1%} of {group.size} units would leave "
                f"{max(round(wanted / multiple) * multiple, 0)}, fewer than the minimum {floor}"
            )


def removed_params(
    model: nn.Module, groups: list[Group], counts: list[int], part: str, parts: dict[int, tuple[str, bool]]
) -> int:
    """Parameters of ``part`` the counts remove (any name of :data:`PART_NAMES`; ``model`` is ``total``)."""
    part = count_part(part)
    total = 0
    for group, count in zip(groups, counts, strict=True):
        for tensor, per_unit in group.unit_slices(model):
            name, in_layers = parts[id(tensor)]
            if part == "total" or name == part or (part == "layers" and in_layers):
                total += (group.size - count) * per_unit
    return total


def solve_fraction(
    model: nn.Module,
    groups: list[Group],
    scores: list[torch.Tensor],
    rules: SelectionRules,
    part: str,
    wanted: int,
) -> float:
    """The removal fraction whose (rounded) plan removes closest to ``wanted`` parameters of ``part``.

    ``part`` is a recipe target name (``model``, ``layers``, ``mlp``, ``attention``) or a
    ``params_by_part`` count name (``total``, ``embeddings``, ...); see :data:`PART_NAMES`. Raises
    :class:`SlimkitError` for another name, or when the groups cannot remove ``wanted`` parameters.
    """
    part = count_part(part)
    parts = param_parts(model)

    def removed(fraction: float) -> int:
        return removed_params(model, groups, kept_counts(groups, scores, fraction, rules), part, parts)

    most = removed(1.0)
    if wanted > most:
        raise SlimkitError(
            f"the target needs {wanted:,} parameters of {part} removed, but these groups can remove at most "
            f"{most:,} (min_keep {rules.min_keep})"
        )
    return bisect_fraction(removed, wanted, steps=50)


class TargetOutOfReach(SlimkitError):
    """No plan of the groups removes ``wanted`` parameters within ``tolerance``. ``below`` and ``above``: the
    nearest removals the tried plans reach on either side of ``wanted`` (None where none does)."""

    def __init__(self, wanted: int, tolerance: int, below: int | None, above: int | None) -> None:
        self.wanted, self.tolerance, self.below, self.above = wanted, tolerance, below, above
        super().__init__(
            f"no plan of these groups removes {wanted:,} parameters within {tolerance:,}; the nearest remove "
            f"{below if below is None else format(below, ',')} and {above if above is None else format(above, ',')}"
        )


def solve_target(
    model: nn.Module,
    groups: list[Group],
    scores: list[torch.Tensor],
    rules: SelectionRules,
    part: str,
    wanted: int,
    tolerance: int,
) -> Fraction:
    """The removal fraction whose plan removes ``wanted`` parameters of ``part`` within ``tolerance`` parameters.

    The one shared fraction of :func:`solve_fraction` when its plan lands within the tolerance (so plans that
    land stay exactly as they are). Otherwise a coarse kind jumps over the target as the shared fraction grows
    (GQA heads go one query head per KV group at a time): the kinds whose counts change at the jump keep the
    step just below it (or, failing that, just above), and one fraction shared by the other kinds is solved so
    the total lands. Returns ``{kind: fraction}`` then. Raises :class:`TargetOutOfReach` when no tried plan
    lands, before anything is selected.
    """
    part = count_part(part)
    parts = param_parts(model)

    def removed(fraction: Fraction) -> int:
        return removed_params(model, groups, kept_counts(groups, scores, fraction, rules), part, parts)

    shared = solve_fraction(model, groups, scores, rules, part, wanted)
    if abs(removed(shared) - wanted) <= tolerance:
        return shared
    low, high = bracket_fraction(removed, wanted, steps=50)
    at_low, at_high = kept_counts(groups, scores, low, rules), kept_counts(groups, scores, high, rules)
    kinds = list(dict.fromkeys(g.kind for g in groups))
    jumped = {g.kind for g, a, b in zip(groups, at_low, at_high, strict=True) if a != b}
    reached = [removed(low), removed(high)]
    if jumped and len(jumped) < len(kinds):
        for step in (low, high):

            def split(fine: float, step: float = step) -> dict[str, float]:
                return {kind: step if kind in jumped else fine for kind in kinds}

            candidate = split(bisect_fraction(lambda fine: removed(split(fine)), wanted, steps=50))
            reached.append(removed(candidate))
            if abs(reached[-1] - wanted) <= tolerance:
                return candidate
    below = [r for r in reached if r < wanted]
    above = [r for r in reached if r > wanted]
    raise TargetOutOfReach(wanted, tolerance, max(below, default=None), min(above, default=None))


def bracket_fraction(removed: Callable[[float], int], wanted: int, steps: int) -> tuple[float, float]:
    """Fractions ``low < high`` in [0, 1], ``steps`` halvings apart, with ``removed(low) < wanted <=
    removed(high)`` where the range allows (``removed`` non-decreasing)."""
    low, high = 0.0, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        if removed(middle) < wanted:
            low = middle
        else:
            high = middle
    return low, high


def bisect_fraction(removed: Callable[[float], int], wanted: int, steps: int) -> float:
    """The fraction in [0, 1] whose ``removed(fraction)`` (non-decreasing) is closest to ``wanted``."""
    return min(bracket_fraction(removed, wanted, steps), key=lambda f: abs(removed(f) - wanted))


def keep_indices(group: Group, scores: torch.Tensor, count: int, rules: SelectionRules) -> torch.Tensor:
    blocks = group.extra.get("kv_groups", 1)
    if blocks > 1:
        return keep_top_per_block(scores, blocks, count)
    if rules.protect_lowest > 0:
        return protect_lowest(scores, count, rules.protect_lowest)
    return keep_top(scores, count)


def plan(
    groups: list[Group], scores: list[torch.Tensor], fraction: Fraction, rules: SelectionRules
) -> list[torch.Tensor]:
    """Kept unit indices (sorted, into each group's units) for removing ``fraction`` (shared, or per kind).

    Every group is checked first (:func:`check_shapes`, and that no group would fall below its
    minimum), so a plan that cannot hold raises :class:`SlimkitError` before anything is selected.
    GQA attention-head groups keep the same number of query heads in every KV group.
    """
    counts = kept_counts(groups, scores, fraction, rules)
    validate_counts(groups, counts, fraction, rules)
    return [keep_indices(g, s, c, rules) for g, s, c in zip(groups, scores, counts, strict=True)]
