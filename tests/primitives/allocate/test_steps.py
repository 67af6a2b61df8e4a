"""Hull steps of many items taken cheapest first under one budget."""

from __future__ import annotations

from slimkit.primitives.allocate.steps import BudgetStep, cheapest_order, take_cheapest


def test_steps_are_taken_cheapest_first_and_a_step_past_the_budget_blocks_its_item():
    steps = [
        BudgetStep(0, "a0", "a1", 10, 1.0),  # slope 0.1
        BudgetStep(0, "a1", "a2", 10, 3.0),  # 0.3
        BudgetStep(1, "b0", "b1", 30, 6.0),  # 0.2: does not fit after a0 -> blocks b's later step
        BudgetStep(1, "b1", "b2", 5, 0.5),
    ]
    states = ["a0", "b0"]
    assert take_cheapest(steps, states, budget=35) == 20
    assert states == ["a2", "b0"]


def test_an_items_steps_keep_their_order_when_rounding_makes_a_later_slope_smaller():
    # item 0 lies on a straight line whose second slope rounds below its first; item 1 is a hair dearer
    steps = [BudgetStep(0, 0, 1, 3, 0.6), BudgetStep(0, 1, 2, 3, 0.6 - 3e-12), BudgetStep(1, 0, 1, 3, 0.6 + 3e-9)]
    assert cheapest_order(steps) == [0, 1, 2]
    states = [0, 0]
    assert take_cheapest(steps, states, budget=6) == 6
    assert states == [2, 0]  # sorted by raw slope, item 0's second step came first, was skipped, and item 1 went
