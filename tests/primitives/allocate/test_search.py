"""EvoPress-style search over per-layer levels: on the budget, deterministic per seed, finds the cheap layer."""

from __future__ import annotations

import pytest

from slimkit.primitives.allocate import search_levels, uniform_start
from slimkit.primitives.select.plan import TargetOutOfReach

LADDER = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
REMOVED = [[round(1000 * f) for f in LADDER] for _ in range(6)]  # six slots of 1,000 parameters each
WANTED, TOLERANCE = 1500, 0  # a quarter of 6,000


def _fitness(levels: list[int]) -> float:
    """Slot 2 costs nothing to compress; the others cost the square of their fraction."""
    return sum((0.0 if i == 2 else 1.0) * LADDER[level] ** 2 for i, level in enumerate(levels))


def _search(seed: int = 0, max_evals: int = 200):
    return search_levels(REMOVED, WANTED, TOLERANCE, _fitness, budget_s=600, max_evals=max_evals, seed=seed)


def test_the_search_stays_on_the_budget_and_gives_the_free_slot_the_largest_level():
    result = _search()
    assert result.removed == WANTED
    assert sum(REMOVED[i][level] for i, level in enumerate(result.levels)) == WANTED
    assert result.levels[2] == max(result.levels) == 9  # the free slot takes the top of the ladder
    assert len(set(result.levels)) > 1
    assert result.fitness < result.start_fitness
    trace = result.trace
    assert trace.evaluations <= 200 and trace.stopped_by in ("max_evals", "exhausted")
    assert [b[2] for b in trace.best] == sorted((b[2] for b in trace.best), reverse=True)
    assert trace.best[-1][2] == result.fitness


def test_the_search_is_deterministic_per_seed():
    first, again = _search(seed=3, max_evals=40), _search(seed=3, max_evals=40)
    assert first.levels == again.levels and first.fitness == again.fitness
    assert first.trace.evaluations == again.trace.evaluations == 40


def test_the_time_budget_ends_a_search():
    ticks = iter(range(1000))
    result = search_levels(REMOVED, WANTED, TOLERANCE, _fitness, 5, 1000, clock=lambda: float(next(ticks)))
    assert result.trace.stopped_by == "budget_s" and result.trace.evaluations < 10


def test_uniform_start_repairs_onto_the_budget_and_refuses_the_unreachable():
    start = uniform_start(REMOVED, WANTED, TOLERANCE)
    assert sum(REMOVED[i][level] for i, level in enumerate(start)) == WANTED
    with pytest.raises(TargetOutOfReach):
        uniform_start(REMOVED, 5950, 0)


def test_a_zero_budget_is_refused():
    with pytest.raises(ValueError, match="budget_s > 0"):
        search_levels(REMOVED, WANTED, TOLERANCE, _fitness, budget_s=0, max_evals=10)
