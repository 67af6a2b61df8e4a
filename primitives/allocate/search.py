"""EvoPress's search over per-layer levels, with the sum of removed parameters held on the budget.

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slimkit.primitives.select.plan import TargetOutOfReach


@dataclass(frozen=True)
class SearchTrace:
    """How a search went: evaluations made, seconds spent, what ended it (``max_evals``, ``budget_s`` or
    ``exhausted``: no new candidate could be drawn), and the best fitness each time it improved as
    ``(evaluation, seconds, fitness)``."""

    evaluations: int
    seconds: float
    stopped_by: str
    best: list[tuple[int, float, float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "evaluations": self.evaluations,
            "seconds": round(self.seconds, 3),
            "stopped_by": self.stopped_by,
            "best": [{"evaluation": e, "seconds": round(s, 3), "fitness": f} for e, s, f in self.best],
        }


@dataclass(frozen=True)
class SearchResult:
    levels: list[int]
    fitness: float
    removed: int
    start_fitness: float
    trace: SearchTrace


class _Budget:
    """The window of totals a candidate may remove, and the moves that keep a candidate inside it."""

    def __init__(self, removed: list[list[int]], wanted: int, tolerance: int) -> None:
        self.removed, self.low, self.high = removed, wanted - tolerance, wanted + tolerance

    def total(self, levels: list[int]) -> int:
        return sum(r[level] for r, level in zip(self.removed, levels, strict=True))

    def repair(self, levels: list[int], rng: random.Random, limit: int = 2000) -> list[int] | None:
        levels, total = list(levels), self.total(levels)
        for _ in range(limit):
            if self.low <= total <= self.high:
                return levels
            up = total < self.low
            gap = (self.high - total) if up else (total - self.low)
            moves = []
            for i, r in enumerate(self.removed):
                target = levels[i] + (1 if up else -1)
                if 0 <= target < len(r) and r[target] != r[levels[i]]:
                    moves.append((i, target, abs(r[target] - r[levels[i]])))
            if not moves:
                return None
            fitting = [m for m in moves if m[2] <= gap]
            i, target, _step = rng.choice(fitting or moves)
            total += self.removed[i][target] - self.removed[i][levels[i]]
            levels[i] = target
        return None


def uniform_start(removed: list[list[int]], wanted: int, tolerance: int, seed: int = 0) -> list[int]:
    """The shared level whose total is nearest ``wanted``, repaired onto the budget; :class:`TargetOutOfReach`
    when no repair lands."""
    budget = _Budget(removed, wanted, tolerance)
    depth = min(len(r) for r in removed)
    shared = min(range(depth), key=lambda level: abs(budget.total([level] * len(removed)) - wanted))
    start = budget.repair([shared] * len(removed), random.Random(seed))
    if start is None:  # the nearest totals of shared levels on either side
        totals = [budget.total([level] * len(removed)) for level in range(depth)]
        below = max((t for t in totals if t < wanted), default=None)
        raise TargetOutOfReach(wanted, tolerance, below, min((t for t in totals if t > wanted), default=None))
    return start


def search_levels(
    removed: list[list[int]],
    wanted: int,
    tolerance: int,
    fitness: Callable[[list[int]], float],
    budget_s: float,
    max_evals: int,
    seed: int = 0,
    offspring: int = 8,
    start: list[int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """The levels (one per slot) with the lowest ``fitness`` found whose total removal lies within ``tolerance`` of
    ``wanted``, and the trace of the search. ``removed[i][l]``: parameters slot ``i`` removes at level ``l``."""
    if budget_s <= 0 or max_evals < 1:
        raise ValueError("search_levels needs budget_s > 0 and max_evals >= 1")
    rng = random.Random(seed)
    budget = _Budget(removed, wanted, tolerance)
    began = clock()
    seen: dict[tuple[int, ...], float] = {}
    best_trace: list[tuple[int, float, float]] = []

    def evaluate(levels: list[int]) -> float:
        value = float(fitness(levels))
        seen[tuple(levels)] = value
        if not best_trace or value < best_trace[-1][2]:
            best_trace.append((len(seen), clock() - began, value))
        return value

    parent = start if start is not None else uniform_start(removed, wanted, tolerance, seed)
    if not budget.low <= budget.total(parent) <= budget.high:
        raise ValueError("search_levels: the start allocation is outside the budget")
    parent_fitness = start_fitness = evaluate(parent)

    def stop() -> str | None:
        if len(seen) >= max_evals:
            return "max_evals"
        if clock() - began >= budget_s:
            return "budget_s"
        return None

    while (reason := stop()) is None:
        children: list[tuple[float, list[int]]] = []
        for _ in range(offspring):
            if stop() is not None:
                break
            child = _mutate(parent, budget, rng, seen)
            if child is not None:
                children.append((evaluate(child), child))
        if not children:
            reason = stop() or "exhausted"
            break
        value, child = min(children, key=lambda c: c[0])
        if value < parent_fitness:
            parent, parent_fitness = child, value
    trace = SearchTrace(len(seen), clock() - began, reason, best_trace)
    return SearchResult(parent, parent_fitness, budget.total(parent), start_fitness, trace)


def _mutate(parent: list[int], budget: _Budget, rng: random.Random, seen: dict, tries: int = 32) -> list[int] | None:
    """A child not evaluated yet: one to three level switches (a slot up, another down), repaired onto the budget."""
    slots = len(parent)
    for _ in range(tries):
        child = list(parent)
        for _switch in range(rng.randint(1, 3)):
            up, down = rng.randrange(slots), rng.randrange(slots)
            if up != down and child[up] + 1 < len(budget.removed[up]) and child[down] > 0:
                child[up] += 1
                child[down] -= 1
        repaired = budget.repair(child, rng)
        if repaired is not None and tuple(repaired) not in seen:
            return repaired
    return None


__all__ = ["SearchResult", "SearchTrace", "search_levels", "uniform_start"]
