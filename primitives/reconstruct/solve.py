"""Damped symmetric solves shared by every refit: ``X = B (G + λI)⁻¹`` and ``(G + λI)⁻¹``.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DEFAULT_DAMPING = 1e-6
"""Relative ridge for least-squares refits (:mod:`.least_squares`, :mod:`.lowrank_refit`).

Small on purpose: the ridge shrinks the refit towards **zero**, and ``mean(diag(G))`` of an LLM's
MLP activations is dominated by a few outlier channels (often 100x the median), so a SparseGPT-size
0.01 would shrink the weights of ordinary channels by tens of percent. 1e-6 only makes the solve
well posed (dead channels, rank-deficient calibration); Cholesky escalates if it is not enough."""

DEFAULT_OBS_DAMPING = 0.01
"""Relative damping of the OBS Hessian (SparseGPT's / ZipLM's ``percdamp``).

OBS damping adds ``λ||W' − W||²`` to the objective (it shrinks the update towards the **dense**
weight, not towards zero), so the usual 1% is harmless there."""

FALLBACK_FLOOR = 1e-10
"""Relative damping the first retry escalates from when the requested damping is 0."""

Method = Literal["cholesky", "lstsq", "unchanged"]


@dataclass(frozen=True)
class SolveInfo:
    """How a damped system was solved.

    ``damping`` is the relative factor actually used (after any escalation), ``lam`` the absolute
    ``λ = damping · mean(diag(G))`` added to the diagonal, ``method`` ``"cholesky"`` or ``"lstsq"``
    (or ``"unchanged"`` where a refit returned the weight as it was, nothing having been removed)."""

    damping: float
    lam: float
    method: Method


def symmetric(gram: torch.Tensor) -> torch.Tensor:
    """``(G + Gᵀ) / 2`` in float64 on ``G``'s device; raises for a non-square or non-finite ``G``."""
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"expected a square Gram matrix, got shape {tuple(gram.shape)}")
    g = gram.detach().double()
    if not torch.isfinite(g).all():
        raise ValueError("the Gram matrix has non-finite entries")
    return (g + g.T) / 2


def diagonal_scale(gram: torch.Tensor) -> float:
    """``mean(diag(G))``, or 1 when it is not positive (the unit that relative damping multiplies)."""
    if gram.shape[0] == 0:
        return 1.0
    scale = float(gram.diagonal().mean())
    return scale if scale > 0 else 1.0


def _dampings(damping: float, retries: int) -> list[float]:
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    start = damping if damping > 0 else FALLBACK_FLOOR
    return [float(damping)] + [float(start) * 10.0 ** (k + 1) for k in range(retries)]


def _damped(g: torch.Tensor, lam: float) -> torch.Tensor:
    return g + lam * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)


def damped_cholesky(
    gram: torch.Tensor, damping: float, retries: int = 3
) -> tuple[torch.Tensor | None, torch.Tensor, SolveInfo]:
    """Lower Cholesky factor of ``G + λI`` with escalating damping.

    Returns ``(factor, G_sym, info)``; ``factor`` is None when every damping failed (``info`` then
    holds the requested damping and ``method="lstsq"``: the caller falls back to least squares)."""
    g = symmetric(gram)
    scale = diagonal_scale(g)
    for factor_damping in _dampings(damping, retries):
        lam = factor_damping * scale
        factor, status = torch.linalg.cholesky_ex(_damped(g, lam))
        if int(status) == 0 and torch.isfinite(factor).all():
            return factor, g, SolveInfo(factor_damping, lam, "cholesky")
    return None, g, SolveInfo(float(damping), damping * scale, "lstsq")


def damped_solve(
    rhs: torch.Tensor,
    gram: torch.Tensor,
    damping: float = DEFAULT_DAMPING,
    retries: int = 3,
    prior: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SolveInfo]:
    """``X = B (G + λI)⁻¹`` for ``B`` (``m x k``) and a symmetric PSD ``G`` (``k x k``), in float64.

    This is the general ridge least-squares solution ``argmin_X ||T − X Z||² + λ||X||²`` given the
    streamed statistics ``B = Σ_t t_t z_tᵀ`` and ``G = Σ_t z_t z_tᵀ`` (e.g. from
    :class:`~slimkit.primitives.reconstruct.gram.CrossGramAccumulator` with dense outputs ``t``).
    With ``prior`` (``m x k``, e.g. the weights before a refit) the ridge pulls towards it instead of zero,
    ``argmin ||T − X Z||² + λ||X − P||²``, i.e. ``X = (B + λP) (G + λI)⁻¹``, with the λ the plain solve settled on
    (it may have escalated the damping)."""
    solution, info = _damped_solve(rhs, gram, damping, retries)
    if prior is None or info.lam <= 0:
        return solution, info
    if prior.shape != solution.shape:
        raise ValueError(f"prior must have the solution's shape {tuple(solution.shape)}, got {tuple(prior.shape)}")
    target = prior.detach().to(device=solution.device, dtype=torch.float64)
    return _damped_solve(
        rhs.detach().to(device=solution.device, dtype=torch.float64) + info.lam * target, gram, info.damping, retries
    )


def _damped_solve(
    rhs: torch.Tensor, gram: torch.Tensor, damping: float, retries: int
) -> tuple[torch.Tensor, SolveInfo]:
    """:func:`damped_solve` without a prior."""
    if rhs.dim() != 2 or rhs.shape[1] != gram.shape[-1]:
        raise ValueError(f"rhs must be m x {gram.shape[-1]} for a {tuple(gram.shape)} Gram, got {tuple(rhs.shape)}")
    factor, g, info = damped_cholesky(gram, damping, retries)
    b = rhs.detach().to(device=g.device, dtype=torch.float64)
    if g.shape[0] == 0:
        return b.new_zeros(b.shape), info
    if factor is not None:
        solution = torch.cholesky_solve(b.T, factor).T
        if torch.isfinite(solution).all():
            return solution, info
        info = SolveInfo(damping, damping * diagonal_scale(g), "lstsq")
    system = _damped(g, info.lam).cpu()
    solution = torch.linalg.lstsq(system, b.T.cpu(), driver="gelsd").solution.T
    return solution.to(g.device), info


def damped_inverse(
    gram: torch.Tensor, damping: float = DEFAULT_OBS_DAMPING, retries: int = 3
) -> tuple[torch.Tensor, SolveInfo]:
    """``(G + λI)⁻¹`` in float64 (Cholesky inverse; the pseudo-inverse when every damping fails)."""
    factor, g, info = damped_cholesky(gram, damping, retries)
    if factor is not None:
        inverse = torch.cholesky_inverse(factor)
        if torch.isfinite(inverse).all():
            return (inverse + inverse.T) / 2, info
        info = SolveInfo(damping, damping * diagonal_scale(g), "lstsq")
    inverse = torch.linalg.pinv(_damped(g, info.lam).cpu(), hermitian=True).to(g.device)
    return (inverse + inverse.T) / 2, info


__all__ = [
    "DEFAULT_DAMPING",
    "DEFAULT_OBS_DAMPING",
    "FALLBACK_FLOOR",
    "SolveInfo",
    "damped_cholesky",
    "damped_inverse",
    "damped_solve",
    "diagonal_scale",
    "symmetric",
]
