"""Allocation by the refit's own error: the prefix curve from one Cholesky factor equals the least-squares refit's
error (per output dimension) at every kept count, and the allocation lands on the budget taking the cheapest error
per parameter first."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.allocate import UnitCosts, total_removed
from slimkit.primitives.allocate.refit_error import allocate_by_error, prefix_refit_errors
from slimkit.primitives.select.plan import TargetOutOfReach


def _least_squares_error(weight: torch.Tensor, inputs: torch.Tensor, kept_columns: list[int]) -> float:
    """Mean over output dimensions i of ||(W X - W' X_K)_i||² / ||(W X)_i||², W' the plain least-squares refit
    (explicit solve)."""
    target = weight @ inputs
    if not kept_columns:
        return 1.0
    kept = inputs[kept_columns]
    refit = torch.linalg.lstsq(kept.T, target.T).solution.T
    return float(((target - refit @ kept).pow(2).sum(1) / target.pow(2).sum(1)).mean())


def test_the_prefix_curve_is_the_least_squares_refit_error_at_every_kept_count():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8, 200, generator=generator, dtype=torch.float64)
    # a column the others nearly reproduce (exactly would make G singular): removing it costs almost nothing
    inputs[5] = inputs[0] + 0.5 * inputs[2] + 1e-2 * torch.randn(200, generator=generator, dtype=torch.float64)
    weight = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    columns = torch.arange(8).reshape(4, 2)  # units of two columns: (0,1) (2,3) (4,5) (6,7)
    order = torch.tensor([3, 0, 1, 2])  # kept longest first
    curve = prefix_refit_errors(weight, inputs @ inputs.T, columns, order, jitter=1e-12)
    assert curve.shape == (5,) and float(curve[0]) == pytest.approx(1.0) and float(curve[4]) == pytest.approx(0.0)
    for kept in range(5):
        kept_columns = columns[order[:kept]].flatten().tolist()
        assert float(curve[kept]) == pytest.approx(_least_squares_error(weight, inputs, kept_columns), abs=1e-9)


def test_columns_no_unit_occupies_are_always_kept():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(5, 100, generator=generator, dtype=torch.float64)
    weight = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    columns = torch.tensor([[1], [3], [4]])  # columns 0 and 2 belong to no unit
    curve = prefix_refit_errors(weight, inputs @ inputs.T, columns, torch.tensor([2, 0, 1]), jitter=1e-12)
    assert float(curve[0]) == pytest.approx(_least_squares_error(weight, inputs, [0, 2]), abs=1e-9)
    assert float(curve[1]) == pytest.approx(_least_squares_error(weight, inputs, [0, 2, 4]), abs=1e-9)


def test_a_bad_order_is_refused():
    with pytest.raises(ValueError, match="permutation of the 2 units"):
        prefix_refit_errors(torch.ones(1, 2), torch.eye(2), torch.tensor([[0], [1]]), torch.tensor([0, 0]))


def _linear(size: int, per_unit: float) -> torch.Tensor:
    """Relative error ``per_unit`` for each unit removed: curve[k] = (size - k) * per_unit."""
    return torch.tensor([(size - k) * per_unit for k in range(size + 1)], dtype=torch.float64)


def test_the_cheapest_group_gives_first_down_to_its_minimum_then_the_next():
    # three groups of 16 units, 10 parameters a unit; group 1 is ten times cheaper per unit than group 0, group 2
    # costs nothing to its first 4 units removed, then a lot
    costs = [UnitCosts("mlp_channel", layer, 16, 10, minimum=4) for layer in range(3)]
    steep = torch.tensor([1.0 if k < 12 else 0.0 for k in range(17)], dtype=torch.float64)
    curves = [_linear(16, 0.1), _linear(16, 0.01), steep]
    assert allocate_by_error(curves, costs, wanted=10 * 20, tolerance=0) == [12, 4, 12]  # then 4 of group 0
    kept = allocate_by_error(curves, costs, wanted=10 * 16, tolerance=0)
    assert kept == [16, 4, 12]  # group 2's four free units (40), then group 1 down to its minimum (120)
    assert total_removed(costs, kept) == 160


def test_aligned_counts_land_within_the_tolerance():
    costs = [UnitCosts("mlp_channel", layer, 64, 144, multiple=8) for layer in range(3)]
    curves = [_linear(64, 0.02), _linear(64, 0.01), _linear(64, 0.03)]
    wanted = 64 * 3 * 144 // 4
    kept = allocate_by_error(curves, costs, wanted, tolerance=144 * 4)
    assert kept == [64, 16, 64]  # the cheapest group gives its 48 units (down to 16, a multiple of 8)
    curves[1] = torch.cat([torch.full((32,), 0.5, dtype=torch.float64), torch.zeros(33, dtype=torch.float64)])
    kept = allocate_by_error(curves, costs, wanted, tolerance=144 * 4)  # group 1: 32 units free, then costly
    assert kept == [48, 32, 64] and all(k % 8 == 0 for k in kept)
    assert wanted - 144 * 4 <= total_removed(costs, kept) <= wanted


def test_a_budget_beyond_every_minimum_is_out_of_reach():
    costs = [UnitCosts("mlp_channel", 0, 8, 10, minimum=4)]
    with pytest.raises(TargetOutOfReach):
        allocate_by_error([_linear(8, 0.1)], costs, wanted=60, tolerance=5)


def test_a_consumer_reading_only_zeros_loses_nothing_and_a_non_finite_gram_is_refused():
    columns, order = torch.tensor([[0], [1]]), torch.tensor([1, 0])
    assert torch.equal(prefix_refit_errors(torch.ones(2, 2), torch.zeros(2, 2), columns, order), torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        prefix_refit_errors(torch.ones(2, 2), torch.full((2, 2), float("nan")), columns, order)


def test_one_massive_output_dimension_does_not_hide_the_others():
    """Output 0 is a hundred times larger than output 1 and reads only unit 0: keeping unit 0 keeps almost all the
    output energy, but half of the output dimensions lose everything."""
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(2, 300, generator=generator, dtype=torch.float64)
    weight = torch.tensor([[100.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    curve = prefix_refit_errors(weight, inputs @ inputs.T, torch.tensor([[0], [1]]), torch.tensor([0, 1]), 1e-12)
    assert float(curve[1]) == pytest.approx(0.5, abs=0.02)  # output 1 lost (but its chance correlation with x0)
