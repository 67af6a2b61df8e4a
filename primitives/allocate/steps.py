"""Taking steps of many items' lower convex hulls cheapest first under one budget (the Lagrangian sweep both hull
allocations share: :func:`slimkit.primitives.allocate.refit_error.allocate_by_error` over kept counts and
:func:`slimkit.primitives.lowrank.rank_allocation.allocate_ranks` over ranks).

Each item (a group of units, a matrix) has steps from its current state to the next one, each removing ``amount``
parameters at ``cost`` (the error it adds). Steps are taken in order of cost per parameter; an item's own steps keep
their order (each starts where the previous one ended; on a convex hull their slopes do not decrease, so equal
slopes that differ by rounding are read as equal). A step that would pass the budget is skipped with every later step
of its item; the result lands at most on the budget.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetStep:
    """One hull step of item ``item``: from state ``start`` to ``end``, removing ``amount`` parameters at ``cost``."""

    item: int
    start: Hashable
    end: Hashable
    amount: int
    cost: float

    @property
    def slope(self) -> float:
        return self.cost / self.amount


def cheapest_order(steps: list[BudgetStep]) -> list[int]:
    """Indices of ``steps`` cheapest per parameter first, each item's steps in their own order."""
    keys: list[tuple[float, int, int]] = []
    running: dict[int, float] = {}
    for position, step in enumerate(steps):
        slope = max(step.slope, running.get(step.item, float("-inf")))
        running[step.item] = slope
        keys.append((slope, step.item, position))
    return sorted(range(len(steps)), key=keys.__getitem__)


def take_cheapest(steps: list[BudgetStep], states: list, budget: int) -> int:
    """Take ``steps`` cheapest first while they fit in ``budget``, updating ``states`` (each item's current state, in
    place); returns the parameters the taken steps remove."""
    blocked: set[int] = set()
    taken = 0
    for index in cheapest_order(steps):
        step = steps[index]
        if step.item in blocked or states[step.item] != step.start:
            continue
        if taken + step.amount > budget:
            blocked.add(step.item)  # its later steps start from this one
            continue
        states[step.item] = step.end
        taken += step.amount
    return taken


__all__ = ["BudgetStep", "cheapest_order", "take_cheapest"]
