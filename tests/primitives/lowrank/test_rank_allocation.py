"""Global rank allocation (primitives/lowrank/rank_allocation.py) and the spectra it reads (svd.singular_energies)."""

from __future__ import annotations

import itertools

import pytest
import torch

from slimkit.primitives.lowrank import activation_weighted_svd, singular_energies, truncated_svd, weighted_error
from slimkit.primitives.lowrank.rank_allocation import (
    MatrixSpectrum,
    RankBudgetOutOfReach,
    allocate_ranks,
    hull_steps,
    min_rank_for,
    relative_tail,
    saved_params,
)


def spectrum(energies: list[float], d_out: int = 10, d_in: int = 10, max_rank: int = 4, min_rank: int = 1):
    return MatrixSpectrum(d_out, d_in, torch.tensor(energies, dtype=torch.float64), max_rank, min_rank)


def test_relative_tail_hand_case():
    assert relative_tail(torch.tensor([3.0, 1.0])).tolist() == [1.0, 0.25, 0.0]
    assert relative_tail(torch.zeros(2)).tolist() == [0.0, 0.0, 0.0]  # a zero matrix loses nothing


def test_min_rank_for_hand_case():
    # 10 x 10: 100 parameters, a rank costs 20; removing at most 50% keeps >= 50 -> rank 3 (60), not 2 (40)
    assert min_rank_for(10, 10, 0.5) == 3
    assert min_rank_for(10, 10, 1.0) == 1
    with pytest.raises(ValueError, match="max_fraction"):
        min_rank_for(10, 10, 0.0)


def test_hull_starts_at_the_cheapest_rank_per_parameter_and_its_slopes_rise():
    # 10 x 10 (break-even rank 5), ranks 1..4 allowed: saved 80, 60, 40, 20 at ranks 1, 2, 3, 4
    s = spectrum([8.0, 1.0, 0.5, 0.3, 0.2])  # total 10: tails 0.2, 0.1, 0.05, 0.02 at ranks 1..4
    steps = hull_steps(0, s)
    # error per parameter: rank 4 0.02/20 = 0.001, rank 3 0.05/40, rank 2 0.1/60, rank 1 0.2/80 -> rank 4 first
    assert (steps[0].start, steps[0].end, steps[0].amount) == (None, 4, 20)
    assert [(st.start, st.end) for st in steps[1:]] == [(4, 3), (3, 2), (2, 1)]
    slopes = [st.slope for st in steps]
    assert slopes == sorted(slopes)
    assert [st.amount for st in steps[1:]] == [20, 20, 20]


def test_the_matrix_whose_energy_is_concentrated_loses_more():
    concentrated = spectrum([100.0, 0.1, 0.1, 0.1, 0.1])
    flat = spectrum([1.0, 1.0, 1.0, 1.0, 1.0])
    ranks = allocate_ranks([concentrated, flat], wanted=80)
    assert ranks[0] == 1  # saves 80 alone at 0.4% of its energy
    assert ranks[1] is None


def test_the_plan_lands_at_most_wanted_within_one_step_and_matches_the_best_plan():
    torch.manual_seed(0)
    spectra = [
        spectrum(sorted(torch.rand(5).tolist(), reverse=True)),
        spectrum(sorted((torch.rand(5) ** 4).tolist(), reverse=True)),
        spectrum(sorted((torch.rand(5) * 3).tolist(), reverse=True)),
    ]
    options = [None, 1, 2, 3, 4]
    for wanted in (20, 50, 100, 140, 200):
        ranks = allocate_ranks(spectra, wanted, tolerance=20)
        saved = saved_params(spectra, ranks)
        assert wanted - 20 <= saved <= wanted

        def error(plan):
            return sum(float(relative_tail(s.energies)[r]) if r else 0.0 for s, r in zip(spectra, plan, strict=True))

        best = min(
            (plan for plan in itertools.product(options, repeat=3) if saved_params(spectra, list(plan)) == saved),
            key=error,
        )
        assert error(ranks) == pytest.approx(error(best))


def test_a_budget_beyond_every_matrix_at_its_lowest_rank_is_out_of_reach():
    s = spectrum([1.0, 1.0, 1.0], min_rank=3)  # saves 40 at most
    with pytest.raises(RankBudgetOutOfReach, match="at most 40"):
        allocate_ranks([s], wanted=61, tolerance=20)
    assert allocate_ranks([s], wanted=60, tolerance=20) == [3]


def test_a_matrix_without_a_useful_rank_stays_dense():
    # the second: per parameter saved, rank 4 (0.25 / 7.75 over 20) < rank 3 < rank 2: three steps of 20
    assert allocate_ranks([spectrum([9.0] * 5, max_rank=0), spectrum([4, 2, 1, 0.5, 0.25])], wanted=60) == [None, 2]


def test_energies_are_the_squared_error_each_method_leaves():
    torch.manual_seed(0)
    weight = torch.randn(6, 8, dtype=torch.float64)
    norms = torch.rand(8, dtype=torch.float64) + 0.1
    plain, weighted = singular_energies(weight), singular_energies(weight, input_norms=norms)
    for rank in (1, 3, 5):
        left, right = truncated_svd(weight, rank)
        assert float(plain[rank:].sum()) == pytest.approx(weighted_error(weight, left, right) ** 2)
        left, right = activation_weighted_svd(weight, norms, rank)
        assert float(weighted[rank:].sum()) == pytest.approx(weighted_error(weight, left, right, norms) ** 2)
    inputs = torch.randn(8, 40, dtype=torch.float64)
    whitened = singular_energies(weight, gram=inputs @ inputs.T)
    total = float(torch.linalg.matrix_norm(weight @ inputs) ** 2)
    assert float(whitened.sum()) == pytest.approx(total, rel=1e-4)  # the calibration output energy
