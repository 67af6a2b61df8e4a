"""Exact selection of one candidate per slot under budgets: a mixed-integer program solved by HiGHS.

A slot is one sub-block of one layer; each candidate has a score (lower is better) and a cost under each budget.
One binary per candidate, one equality per slot, two bounds per budget, the summed score minimised (Puzzle's program,
Model-Optimizer's ``puzzletron/mip``), solved by SciPy's :func:`scipy.optimize.milp` to a relative gap of
:data:`MIP_REL_GAP`; the chosen candidates' totals are recomputed exactly and checked against the bounds.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from slimkit.primitives.errors import SlimkitError

MIP_REL_GAP = 1e-9
"""HiGHS stops when its bound proves the choice within this relative gap of the optimum (its default is 1e-4)."""
Table = Sequence[Sequence[float]]
"""One number per candidate of each slot: ``table[slot][candidate]``."""


@dataclass(frozen=True)
class Budget:
    """One linear budget: each candidate's cost, and the bounds the chosen candidates' summed cost must lie in."""

    name: str
    costs: Table
    upper: float = math.inf
    lower: float = -math.inf


@dataclass(frozen=True)
class Selection:
    """The chosen candidate of every slot, the summed score, each budget's total, and how the solve ended."""

    choice: list[int]
    objective: float
    totals: dict[str, float]
    optimal: bool
    seconds: float
    gap: float | None = None
    notes: list[str] = field(default_factory=list)


class NoFeasibleChoice(SlimkitError):
    """No choice of one candidate per slot meets every budget (or none was found within the time limit)."""


def _check(scores: Table, budgets: Sequence[Budget]) -> None:
    if not scores or any(len(slot) == 0 for slot in scores):
        raise SlimkitError("selection: every slot needs at least one candidate")
    for slot, values in enumerate(scores):
        if not all(math.isfinite(v) for v in values):
            raise SlimkitError(f"selection: slot {slot} has a score that is not a finite number")
    for budget in budgets:
        if len(budget.costs) != len(scores) or any(len(c) != len(s) for c, s in zip(budget.costs, scores, strict=True)):
            raise SlimkitError(f"selection: budget {budget.name}'s costs do not match the candidates slot by slot")
        if not all(math.isfinite(v) for slot in budget.costs for v in slot):
            raise SlimkitError(f"selection: budget {budget.name} has a cost that is not a finite number")
        if math.isnan(budget.lower) or math.isnan(budget.upper) or budget.lower > budget.upper:
            raise SlimkitError(f"selection: budget {budget.name}'s bounds {budget.lower}..{budget.upper} are empty")


def reachable(budget: Budget) -> tuple[float, float]:
    """The least and the largest total of ``budget`` over all choices (each slot its cheapest / dearest)."""
    return sum(min(slot) for slot in budget.costs), sum(max(slot) for slot in budget.costs)


def totals_of(choice: Sequence[int], scores: Table, budgets: Sequence[Budget]) -> tuple[float, dict[str, float]]:
    """The summed score and each budget's total of one choice (computed exactly, in Python floats)."""
    objective = math.fsum(scores[s][c] for s, c in enumerate(choice))
    return objective, {b.name: math.fsum(b.costs[s][c] for s, c in enumerate(choice)) for b in budgets}


def _within(total: float, budget: Budget) -> bool:
    slack = 1e-9 * max(1.0, abs(budget.lower) if math.isfinite(budget.lower) else 0.0, abs(total))
    slack = max(slack, 1e-9 * max(1.0, abs(budget.upper) if math.isfinite(budget.upper) else 0.0))
    return budget.lower - slack <= total <= budget.upper + slack


def select(scores: Table, budgets: Sequence[Budget], time_limit: float | None = None) -> Selection:
    """One candidate per slot minimising the summed score within every budget (see the module docstring).

    Raises :class:`NoFeasibleChoice` naming the budget that no choice reaches (from its reachable range), or saying
    that the budgets together exclude every choice."""
    _check(scores, budgets)
    for budget in budgets:
        least, most = reachable(budget)
        if least > budget.upper or most < budget.lower:
            raise NoFeasibleChoice(
                f"no choice of candidates meets budget {budget.name}: the candidates reach {least:g}..{most:g}, "
                f"the budget asks {budget.lower:g}..{budget.upper:g}"
            )
    offsets = np.cumsum([0] + [len(slot) for slot in scores])
    count = int(offsets[-1])
    objective = np.concatenate([np.asarray(slot, dtype=np.float64) for slot in scores])
    objective = objective / (float(np.abs(objective).max()) or 1.0)  # the same optimum; the solver's gaps are relative
    rows, cols, values = [], [], []
    for slot in range(len(scores)):
        for column in range(int(offsets[slot]), int(offsets[slot + 1])):
            rows.append(slot)
            cols.append(column)
            values.append(1.0)
    constraints = [LinearConstraint(csr_array((values, (rows, cols)), shape=(len(scores), count)), 1.0, 1.0)]
    for budget in budgets:
        row = np.concatenate([np.asarray(slot, dtype=np.float64) for slot in budget.costs])
        scale = float(np.abs(row).max()) or 1.0
        constraints.append(LinearConstraint(row[None, :] / scale, budget.lower / scale, budget.upper / scale))
    options: dict[str, float] = {"mip_rel_gap": MIP_REL_GAP}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    start = time.perf_counter()
    result = milp(objective, integrality=np.ones(count), bounds=Bounds(0, 1), constraints=constraints, options=options)
    seconds = time.perf_counter() - start
    if result.x is None:
        why = "the budgets together exclude every choice" if result.status == 2 else result.message
        raise NoFeasibleChoice(f"no choice of candidates meets every budget: {why}")
    chosen = [int(np.argmax(result.x[offsets[s] : offsets[s + 1]])) for s in range(len(scores))]
    value, totals = totals_of(chosen, scores, budgets)
    for budget in budgets:
        if not _within(totals[budget.name], budget):
            raise NoFeasibleChoice(
                f"the solver's choice totals {totals[budget.name]:g} on budget {budget.name}, outside "
                f"{budget.lower:g}..{budget.upper:g} (a numerical problem: report it)"
            )
    notes = [] if result.status == 0 else [f"the solver stopped before proving optimality: {result.message}"]
    gap = getattr(result, "mip_gap", None)
    return Selection(chosen, value, totals, result.status == 0, seconds, gap, notes)


def same_choice(names: Sequence[Sequence[str]], tied: Sequence[bool]) -> list[Budget]:
    """Budgets that make the tied slots with the same candidate names (in the same order) choose the same name.

    ``names[slot]`` lists a slot's candidates; each group of tied slots with equal lists gets, for every later slot
    and every name but the first, the equality ``[slot picks name] - [the group's first slot picks name] = 0`` (the
    first name follows, since each slot picks exactly one). Slots not tied, or alone in their group, are free."""
    if len(names) != len(tied):
        raise SlimkitError("selection: same_choice needs one tied flag per slot")
    groups: dict[tuple[str, ...], list[int]] = {}
    for slot, (slot_names, is_tied) in enumerate(zip(names, tied, strict=True)):
        if is_tied:
            groups.setdefault(tuple(slot_names), []).append(slot)
    budgets = []
    for group_names, members in groups.items():
        first = members[0]
        for other in members[1:]:
            for position in range(1, len(group_names)):
                costs = [[0.0] * len(slot_names) for slot_names in names]
                costs[other][position] = 1.0
                costs[first][position] = -1.0
                name = f"same choice: slot {other} as slot {first} ({group_names[position]})"
                budgets.append(Budget(name, costs, upper=0.0, lower=0.0))
    return budgets


__all__ = ["Budget", "NoFeasibleChoice", "Selection", "Table", "reachable", "same_choice", "select", "totals_of"]
