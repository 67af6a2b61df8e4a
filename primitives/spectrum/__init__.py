"""Spectra of weight matrices and distances between them (PruneNet, "You Only Prune Once", Sengupta et al.; §3.3, §4.2).

Method note: docs/methods/prunenet-policy.md.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

SpectrumMethod = Literal["gram", "svd"]
SPECTRUM_METHODS: tuple[str, ...] = ("gram", "svd")


def singular_values(
    weight: torch.Tensor, dtype: torch.dtype = torch.float32, method: SpectrumMethod = "gram"
) -> torch.Tensor:
    """The ``min(rows, cols)`` singular values of ``weight`` (descending), computed in ``dtype``, on its device.

    ``gram``: the square roots of the eigenvalues of the smaller Gram matrix (``WᵀW`` or ``WWᵀ``, clamped at 0);
    one ``min²·max`` product and one symmetric eigenvalue problem of side ``min(rows, cols)``, far cheaper than an
    SVD of a tall matrix (on a GPU above all). Squaring halves the relative precision of the smallest values
    (an absolute error of about ``eps·σ_max²`` on ``σ²``). ``svd``: ``torch.linalg.svdvals``.
    """
    if weight.dim() != 2:
        raise ValueError(f"singular_values needs a matrix, got shape {tuple(weight.shape)}")
    if method not in SPECTRUM_METHODS:
        raise ValueError(f"unknown spectrum method {method!r}; allowed: {', '.join(SPECTRUM_METHODS)}")
    with torch.no_grad():
        w = weight.detach().to(dtype)
        if method == "svd":
            return torch.linalg.svdvals(w)
        gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
        return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flip(0)


def _samples(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.as_tensor(a).detach().flatten().to("cpu", torch.float64)
    b = torch.as_tensor(b).detach().flatten().to("cpu", torch.float64)
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError("both samples need at least one value")
    if torch.isnan(a).any() or torch.isnan(b).any():
        raise ValueError("samples contain NaN")
    return torch.sort(a).values, torch.sort(b).values


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov–Smirnov distance (Eq. 6): ``max_x |F_a(x) - F_b(x)|`` over the pooled values.

    ``F(x)`` counts values ``<= x``; evaluating at every pooled value suffices because both CDFs
    are right-continuous step functions that only jump there. Symmetric, in [0, 1].
    """
    a, b = _samples(a, b)
    pooled = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, pooled, right=True).to(torch.float64) / a.numel()
    cdf_b = torch.searchsorted(b, pooled, right=True).to(torch.float64) / b.numel()
    return float((cdf_a - cdf_b).abs().max())


def anderson_darling(a: torch.Tensor, b: torch.Tensor, standardized: bool = False) -> float:
    """k-sample Anderson–Darling statistic for k = 2 (Scholz & Stephens 1987, midrank ``A2akN``, Eq. 7).

    With pooled sorted values ``Z`` (size ``N``), distinct values ``z_j``, ``l_j`` the multiplicity
    of ``z_j`` in ``Z``, ``B_j = #{Z < z_j} + l_j / 2`` and ``M_ij = #{sample_i < z_j} + f_ij / 2``
    (``f_ij`` the multiplicity of ``z_j`` in sample ``i``)::

        A2akN = (N - 1) / N * sum_i 1/n_i * sum_j l_j / N * (N M_ij - n_i B_j)^2 / (B_j (N - B_j) - N l_j / 4)

    Every term is >= 0, and the statistic is 0 when both samples are equal. With
    ``standardized=True`` the value is ``(A2akN - 1) / sigma_N`` (Scholz & Stephens' Eq. 4 variance),
    the number ``scipy.stats.anderson_ksamp(...).statistic`` reports. If every pooled value is the
    same there is nothing to tell apart and 0 is returned.
    """
    a, b = _samples(a, b)
    samples = (a, b)
    z = torch.sort(torch.cat(samples)).values
    n_total = z.numel()
    distinct = torch.unique(z)
    if distinct.numel() < 2:
        return 0.0
    below = torch.searchsorted(z, distinct, right=False).to(torch.float64)
    mult = torch.searchsorted(z, distinct, right=True).to(torch.float64) - below
    b_j = below + mult / 2.0
    denom = b_j * (n_total - b_j) - n_total * mult / 4.0
    statistic = 0.0
    for s in samples:
        left = torch.searchsorted(s, distinct, right=False).to(torch.float64)
        right = torch.searchsorted(s, distinct, right=True).to(torch.float64)
        m_ij = right - (right - left) / 2.0
        inner = mult / n_total * (n_total * m_ij - b_j * s.numel()) ** 2 / denom
        statistic += float(inner.sum()) / s.numel()
    statistic *= (n_total - 1.0) / n_total
    if not standardized:
        return statistic
    return (statistic - 1.0) / math.sqrt(_ad_variance([a.numel(), b.numel()], n_total))


def _ad_variance(sizes: list[int], n_total: int) -> float:
    """Variance of ``A2kN`` under the null (Scholz & Stephens 1987, Eq. 4), as scipy computes it."""
    if n_total < 4:
        raise ValueError("the standardized Anderson–Darling statistic needs at least 4 pooled values")
    k = len(sizes)
    big_h = sum(1.0 / n for n in sizes)
    tail = torch.cumsum(1.0 / torch.arange(n_total - 1, 1, -1, dtype=torch.float64), 0)
    h = float(tail[-1]) + 1.0
    g = float((tail / torch.arange(2, n_total, dtype=torch.float64)).sum())
    a = (4 * g - 6) * (k - 1) + (10 - 6 * g) * big_h
    b = (2 * g - 4) * k**2 + 8 * h * k + (2 * g - 14 * h - 4) * big_h - 8 * h + 4 * g - 6
    c = (6 * h + 2 * g - 2) * k**2 + (4 * h - 4 * g + 6) * k + (2 * h - 6) * big_h + 4 * h
    d = (2 * h + 6) * k**2 - 4 * h * k
    n = float(n_total)
    return (a * n**3 + b * n**2 + c * n + d) / ((n - 1.0) * (n - 2.0) * (n - 3.0))


DISTANCES = {"ks": ks_distance, "ad": anderson_darling}
"""Spectral distances by name: the paper's KS penalty (Eq. 6) and the Anderson–Darling one (Table 18)."""


__all__ = ["DISTANCES", "SPECTRUM_METHODS", "SpectrumMethod", "anderson_darling", "ks_distance", "singular_values"]
