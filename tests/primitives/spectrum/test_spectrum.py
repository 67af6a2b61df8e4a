"""Spectral distances (PruneNet Eq. 6 and the Anderson–Darling penalty of Table 18)."""

from __future__ import annotations

import warnings

import pytest
import torch

from slimkit.primitives.spectrum import anderson_darling, ks_distance, singular_values


def test_singular_values_match_svd_and_dtype():
    w = torch.randn(12, 5)
    values = singular_values(w, torch.float64)
    assert values.dtype == torch.float64 and values.shape == (5,)
    torch.testing.assert_close(values, torch.linalg.svd(w.double()).S)
    assert torch.all(values[:-1] >= values[1:])


def test_ks_hand_computed():
    # F_a steps 1/3 at 1, 2, 3; F_b steps 1/2 at 2, 4. |F_a - F_b| at 1, 2, 3, 4: 1/3, 1/6, 1/2, 0.
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0])
    assert ks_distance(a, b) == pytest.approx(0.5)
    assert ks_distance(b, a) == pytest.approx(0.5)


def test_ks_ties_are_counted_together():
    # At x=1: F_a = 2/3, F_b = 1/3; at x=2 both are 1. A merge that steps one value at a time would
    # see 1/3 - 0 then 2/3 - 0 = 2/3 inside the tie.
    a, b = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 2.0])
    assert ks_distance(a, b) == pytest.approx(1 / 3)


def test_ks_identical_and_symmetric():
    a, b = torch.randn(40), torch.randn(25) + 0.3
    assert ks_distance(a, a.clone()) == 0.0
    assert ks_distance(a, b) == pytest.approx(ks_distance(b, a))
    assert 0.0 < ks_distance(a, b) <= 1.0
    assert ks_distance(torch.zeros(3), torch.ones(4)) == 1.0


def test_ad_nonnegative_zero_for_identical_and_grows_with_shift():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(200, generator=g), torch.randn(150, generator=g)
    assert anderson_darling(a, a.clone()) == pytest.approx(0.0, abs=1e-12)
    same = anderson_darling(a, b)
    shifted = anderson_darling(a, b + 1.0)
    assert 0.0 <= same < shifted
    assert anderson_darling(a, b + 2.0) > shifted
    assert anderson_darling(a, b) == pytest.approx(anderson_darling(b, a))


def test_ad_handles_ties_and_degenerate_samples():
    a = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0])
    b = torch.tensor([1.0, 2.0, 2.0, 4.0])
    assert anderson_darling(a, b) > 0.0
    assert anderson_darling(torch.ones(3), torch.ones(4)) == 0.0


def test_matches_scipy_when_available():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(1)
    for trial in range(4):
        # integer-valued samples have many ties, continuous ones none
        if trial % 2:
            a, b = torch.randint(0, 6, (30,), generator=g).double(), torch.randint(0, 8, (17,), generator=g).double()
        else:
            a, b = torch.randn(30, generator=g).double(), torch.randn(17, generator=g).double() + 0.5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = stats.anderson_ksamp([a.numpy(), b.numpy()], variant="midrank").statistic
        assert anderson_darling(a, b, standardized=True) == pytest.approx(expected, rel=1e-9)
        assert ks_distance(a, b) == pytest.approx(stats.ks_2samp(a.numpy(), b.numpy()).statistic)


def test_slicing_rows_keeps_the_spectrum_range():
    # Corollary 3.3 (Cauchy interlacing on W Wᵀ): with no more rows than columns, every singular
    # value of W[S] lies inside the range of W's.
    w = torch.randn(10, 30, dtype=torch.float64)
    full, sliced = singular_values(w, torch.float64), singular_values(w[[0, 2, 3, 7, 9]], torch.float64)
    assert sliced.max() <= full.max() + 1e-12 and sliced.min() >= full.min() - 1e-12


def test_gram_singular_values_by_hand():
    # W = [[3, 0], [0, 4], [0, 0]]: WᵀW = diag(9, 16), singular values 4, 3; the wide Wᵀ reads WWᵀ's (3x3) and
    # gives the same two (its third eigenvalue, 0, is not a singular value of a 2-row matrix).
    w = torch.tensor([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
    for matrix in (w, w.T):
        values = singular_values(matrix, torch.float64, "gram")
        assert values.dtype == torch.float64 and values.tolist() == [4.0, 3.0]


@pytest.mark.parametrize("shape", [(40, 12), (12, 40)])
def test_gram_matches_svd_within_rounding(shape):
    # float64: the squared values' absolute error is about eps·σ_max², so σ agrees to ~1e-12 relative here
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    gram, svd = singular_values(w, torch.float64, "gram"), singular_values(w, torch.float64, "svd")
    assert gram.shape == svd.shape == (12,)
    torch.testing.assert_close(gram, svd, rtol=1e-10, atol=0.0)


def test_gram_and_svd_give_the_same_ks_penalties():
    # the penalties read only the order of the pooled values: on a PruneNet-like draw (kept rows of a tall matrix,
    # float32, as the recipe computes them) both methods give the same KS and Anderson-Darling distances
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(96, 32, generator=generator) * 0.02
    for _ in range(5):
        kept = w[torch.randperm(96, generator=generator)[:77].sort().values]
        spectra = {m: (singular_values(w, method=m), singular_values(kept, method=m)) for m in ("gram", "svd")}
        assert ks_distance(*spectra["gram"]) == ks_distance(*spectra["svd"])
        assert anderson_darling(*spectra["gram"]) == pytest.approx(anderson_darling(*spectra["svd"]), rel=1e-9)


def test_unknown_spectrum_method_is_refused():
    with pytest.raises(ValueError, match="unknown spectrum method 'qr'"):
        singular_values(torch.ones(3, 2), method="qr")  # type: ignore[arg-type]
