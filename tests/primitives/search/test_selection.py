"""The exact selection (``primitives/search/selection.py``): one candidate per slot, least summed score within every
budget, checked against enumerating every choice."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.selection import (
    Budget,
    NoFeasibleChoice,
    reachable,
    same_choice,
    select,
    totals_of,
)

# Three layers, three candidates each: dense (score 0, nothing removed), a half (score, removes 50), removed (score,
# removes 100). Removing at least 120 of 300: the cheapest ways are {layer 2 removed, layer 1 half} at 0.7 or
# {layers 0 and 1 half, layer 2 half} at 0.9 ... enumerated below; by hand: layer 2's candidates are cheapest per
# parameter (0.2 for 50, 0.5 for 100), layer 1's next (0.5 for 50), layer 0's dearest.
SCORES = [[0.0, 1.0, 3.0], [0.0, 0.5, 2.0], [0.0, 0.2, 0.5]]
REMOVED = [[0.0, 50.0, 100.0]] * 3


def _brute_force(scores, budgets):
    best = None
    for choice in itertools.product(*(range(len(slot)) for slot in scores)):
        value, totals = totals_of(choice, scores, budgets)
        if all(b.lower <= totals[b.name] <= b.upper for b in budgets) and (best is None or value < best[0]):
            best = (value, list(choice))
    return best


def test_the_three_layer_toy_picks_the_hand_computed_optimum():
    budget = Budget("removed", REMOVED, lower=120.0)
    result = select(SCORES, [budget])
    # layer 2 removed (0.5, 100) + layer 1 half (0.5, 50): 1.0 for 150; layer 2 removed + layer 0 half: 1.5;
    # all three halves: 1.7; layer 2 half + layer 1 half + layer 0 half ... the enumeration agrees.
    assert result.choice == [0, 1, 2]
    assert result.objective == pytest.approx(1.0)
    assert result.totals == {"removed": 150.0}
    assert result.optimal
    assert _brute_force(SCORES, [budget]) == (pytest.approx(1.0), [0, 1, 2])


def test_an_upper_and_a_lower_bound_together():
    # exactly 100 removed: layer 2 removed (0.5) beats two halves (layer 2 + layer 1: 0.7)
    budget = Budget("removed", REMOVED, lower=100.0, upper=100.0)
    assert select(SCORES, [budget]).choice == [0, 0, 2]


def test_several_budgets_match_enumeration_on_random_tables():
    rng = random.Random(0)
    for _ in range(30):
        slots = rng.randint(2, 4)
        scores = [[0.0] + [rng.random() * 3 for _ in range(rng.randint(1, 3))] for _ in range(slots)]
        params = [[0.0] + [rng.randint(1, 100) for _ in slot[1:]] for slot in scores]
        latency = [[10.0] + [rng.uniform(2.0, 10.0) for _ in slot[1:]] for slot in scores]
        budgets = [
            Budget("params", params, lower=rng.randint(0, 60 * slots)),
            Budget("latency", latency, upper=rng.uniform(6.0, 10.0) * slots),
        ]
        expected = _brute_force(scores, budgets)
        if expected is None:
            with pytest.raises(NoFeasibleChoice):
                select(scores, budgets)
            continue
        result = select(scores, budgets)
        assert result.objective == pytest.approx(expected[0], abs=1e-9)
        value, totals = totals_of(result.choice, scores, budgets)
        assert value == pytest.approx(expected[0], abs=1e-9)
        assert all(b.lower - 1e-6 <= totals[b.name] <= b.upper + 1e-6 for b in budgets)


def test_tied_slots_choose_the_same_candidate_at_the_hand_computed_optimum():
    # The three-layer toy with every layer tied (one width for all): removing at least 120 of 300 needs all three
    # halves (150, score 1.7) or all removed (300, 5.5); free, it was layer 1 half + layer 2 removed (1.0).
    names = [["dense", "half", "removed"]] * 3
    budgets = [Budget("removed", REMOVED, lower=120.0), *same_choice(names, [True] * 3)]
    result = select(SCORES, budgets)
    assert result.choice == [1, 1, 1]
    assert result.objective == pytest.approx(1.7)
    assert _brute_force(SCORES, budgets) == (pytest.approx(1.7), [1, 1, 1])
    # layer 0 free, layers 1 and 2 alike: the enumeration over the same budgets decides
    untied = [Budget("removed", REMOVED, lower=120.0), *same_choice(names, [False, True, True])]
    expected = _brute_force(SCORES, untied)
    assert select(SCORES, untied).choice == expected[1] and expected[1][1] == expected[1][2]


def test_only_slots_with_the_same_candidates_are_tied():
    names = [["dense", "a", "b"], ["dense", "a", "b"], ["dense", "a"], ["dense", "a"]]
    budgets = same_choice(names, [True, True, True, True])
    # two groups: slots 0-1 (names a and b: 2 equalities), slots 2-3 (name a: 1 equality)
    assert len(budgets) == 3
    scores = [[1.0, 0.0, 0.5], [1.0, 0.5, 0.0], [1.0, 0.0], [0.0, 1.0]]
    result = select(scores, budgets)
    assert result.choice[0] == result.choice[1] and result.choice[2] == result.choice[3]
    assert _brute_force(scores, budgets)[1] == result.choice
    with pytest.raises(SlimkitError, match="one tied flag per slot"):
        same_choice(names, [True])


def test_a_budget_no_choice_reaches_is_refused_with_its_range():
    budget = Budget("removed", REMOVED, lower=400.0)
    assert reachable(budget) == (0.0, 300.0)
    with pytest.raises(NoFeasibleChoice, match=r"budget removed: the candidates reach 0\.\.300, the budget asks 400"):
        select(SCORES, [budget])


def test_budgets_that_exclude_each_other_are_refused():
    budgets = [Budget("removed", REMOVED, lower=200.0), Budget("also", REMOVED, upper=100.0)]
    with pytest.raises(NoFeasibleChoice, match="exclude every choice"):
        select(SCORES, budgets)


def test_bad_tables_are_one_line():
    with pytest.raises(Exception, match="slot 1 has a score that is not a finite number"):
        select([[0.0], [math.nan]], [])
    with pytest.raises(Exception, match="do not match the candidates"):
        select(SCORES, [Budget("removed", [[0.0]], lower=0.0)])
    with pytest.raises(Exception, match="at least one candidate"):
        select([[0.0], []], [])
