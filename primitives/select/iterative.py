"""Iterative uniform schedules: every group loses the same fraction of its dense width, step by step.

Method note: docs/methods/selection.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import param_parts
from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.select import keep_top, keep_top_per_block, round_kept
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


SCHEDULE_KINDS: tuple[str, ...] = ("attention_head", "mlp_channel", "hidden_feature")
"""Group kinds an iterative schedule prunes, in the order they are built and cut."""


def schedule_groups(model: nn.Module, kinds: Sequence[str]) -> list[Group]:
    """The model's groups of ``kinds`` (every layer; hidden features model-wide), in :data:`SCHEDULE_KINDS` order."""
    return [g for kind in SCHEDULE_KINDS if kind in kinds for g in build_groups(model, kind)]


def unit_rules(model: nn.Module, groups: Sequence[Group]) -> tuple[list[UnitRule], str]:
    """Each group's rounding rule and, in words, the floors they imply.

    Query heads go in multiples of the KV groups with at least one per group (every KV group keeps
    the same number of query heads, so HF's ``repeat_kv`` layout stays valid); hidden features keep
    at least one head_dim; MLP channels at least one.
    """
    view = ModelView(model)
    head_dim = max(layer.head_dim for layer in view.layers)
    rules, floors = [], []
    for group in groups:
        if group.kind == "attention_head":
            blocks = group.extra.get("kv_groups", 1)
            rules.append(UnitRule(blocks, blocks))
        elif group.kind == "hidden_feature":
            rules.append(UnitRule(1, head_dim))
        else:
            rules.append(UnitRule())
    kinds = {g.kind for g in groups}
    if "attention_head" in kinds:
        least = max(r.minimum for g, r in zip(groups, rules, strict=True) if g.kind == "attention_head")
        floors.append(f"every layer keeps at least {least} query head(s){' (one per KV group)' if least > 1 else ''}")
    if "mlp_channel" in kinds:
        floors.append("every layer keeps at least 1 MLP channel")
    if "hidden_feature" in kinds:
        floors.append(f"the model keeps at least {head_dim} hidden features (one head_dim) of {view.hidden_size}")
    return rules, "; ".join(floors)


def effective_fractions(fractions: Sequence[float], widths: Sequence[int], rules: Sequence[UnitRule]) -> list[float]:
    """Drop iterations whose rounded widths equal the previous iteration's (they would remove nothing)."""
    kept, previous = [], [*widths]
    for fraction in fractions:
        counts = [kept_units(w, fraction, r) for w, r in zip(widths, rules, strict=True)]
        if counts != previous:
            kept.append(fraction)
            previous = counts
    return kept


def cut_to_schedule(
    model: nn.Module,
    groups: Sequence[Group],
    scores: Sequence[torch.Tensor],
    widths: Sequence[int],
    rules: Sequence[UnitRule],
    fraction: float,
) -> None:
    """Cut every group to the width the schedule gives ``fraction`` of its dense width, keeping top scores
    (query heads the same number per KV group)."""
    from slimkit.primitives.surgery import remove_units

    for group, score, width, rule in zip(groups, scores, widths, rules, strict=True):
        kept = kept_units(width, fraction, rule)
        if kept >= group.size:
            continue
        blocks = group.extra.get("kv_groups", 1) if group.kind == "attention_head" else 1
        keep = keep_top_per_block(score, blocks, kept) if blocks > 1 else keep_top(score, kept)
        remove_units(model, group, keep)


Scorer = Callable[[int, list[Group]], list[torch.Tensor]]
"""``score(iteration, groups) -> scores``: the caller's evaluation of the current groups."""


@dataclass(frozen=True)
class Schedule:
    """An iterative schedule fixed before anything changes: the kinds, their dense widths and rules, the
    cumulative fraction of every iteration, the final fraction and the step."""

    kinds: tuple[str, ...]
    widths: tuple[int, ...]
    rules: tuple[UnitRule, ...]
    fractions: tuple[float, ...]
    final: float
    step: float | None


def plan_schedule(
    model: nn.Module,
    kinds: Sequence[str],
    final: float | None = None,
    step: float | None = None,
    iterations: int | None = None,
    part: str = "total",
    wanted: int | None = None,
) -> Schedule:
    """CCE's Algorithm 1 schedule, generalised. The final fraction is ``final``, or solved so that
    ``wanted`` parameters of ``part`` go (raising before any change when the floors forbid it); it is
    reached in steps of ``step`` (default: 1/heads, one query head per layer per iteration) or in
    ``iterations`` equal steps; iterations that would remove nothing are dropped."""
    groups = schedule_groups(model, kinds)
    widths = [g.size for g in groups]
    rules, floors = unit_rules(model, groups)
    if final is None:
        if wanted is None:
            raise ValueError("give final or wanted")
        final = solve_uniform_fraction(model, groups, rules, part, wanted, floors)
    if step is None and iterations is None:
        heads = [
            layer.num_heads for layer in ModelView(model).layers if layer.num_heads
        ]  # a hybrid's first may hold none
        step = 1.0 / (heads[0] if heads else 1)
    fractions = effective_fractions(iteration_fractions(final, step, iterations), widths, rules)
    return Schedule(tuple(kinds), tuple(widths), tuple(rules), tuple(fractions), final, step)


def run_schedule(
    model: nn.Module, schedule: Schedule, score: Scorer, on_iteration: Callable[[int, float], None] | None = None
) -> None:
    """Iterative evaluate-and-prune: every iteration rebuilds the groups, asks ``score`` for their scores and
    cuts each group to its scheduled width of the *dense* width (rounding does not accumulate);
    ``on_iteration(iteration, fraction)`` runs after each cut."""
    for iteration, fraction in enumerate(schedule.fractions):
        current = schedule_groups(model, schedule.kinds)
        cut_to_schedule(model, current, score(iteration, current), schedule.widths, schedule.rules, fraction)
        if on_iteration is not None:
            on_iteration(iteration, fraction)


__all__ = [
    "SCHEDULE_KINDS",
    "Schedule",
    "UnitRule",
    "cut_to_schedule",
    "effective_fractions",
    "iteration_fractions",
    "kept_units",
    "plan_schedule",
    "remaining_params",
    "run_schedule",
    "schedule_groups",
    "solve_uniform_fraction",
    "unit_rules",
]
