"""Truncated SVD and activation-weighted SVD (AWSVD) factorisations of a weight matrix.

A Linear ``y = W x`` replaced by ``y ≈ L R x`` (LoRAP Eq. 3): plain truncated SVD, LoRAP's AWSVD, and whitened
SVD.

Method note: docs/methods/lorap-awsvd.md.
"""

from __future__ import annotations

import torch

from slimkit.primitives.device.moves import math_dtype

WHITEN_DAMPING = 1e-6
"""Relative ridge of :func:`whitened_svd`'s Cholesky factor (the reconstruction family's default)."""

DEFAULT_EPS = 1e-6
"""Relative floor for activation norms in AWSVD: norms are clamped to ``eps * max(norms)``."""


def _check_rank(weight: torch.Tensor, rank: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {tuple(weight.shape)}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    full = min(weight.shape)
    if not 1 <= rank <= full:
        raise ValueError(f"rank must be in [1, {full}] for a {tuple(weight.shape)} matrix, got {rank}")


def _svd_factors(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r Σ_r, V_rᵀ)`` of ``matrix`` (already in the compute dtype)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank] * s[:rank], vh[:rank, :]


def truncated_svd(
    weight: torch.Tensor, rank: int, *, compute_dtype: torch.dtype | None = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` factorisation ``W ≈ L @ R`` (LoRAP Eq. 4).

    Returns ``L = U_r Σ_r`` (``d_out x rank``) and ``R = V_rᵀ`` (``rank x d_in``) in ``weight``'s
    dtype and device. ``rank == min(d_out, d_in)`` reconstructs ``W`` up to round-off.
    ``compute_dtype=None`` computes in ``weight``'s own dtype, at least float32 (torch has no
    bfloat16/float16 SVD).
    """
    _check_rank(weight, rank)
    work = weight.detach().to(compute_dtype or math_dtype(weight.dtype))
    left, right = _svd_factors(work, rank)
    return left.to(weight.dtype), right.to(weight.dtype)


def clamp_norms(input_norms: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """The diagonal of ``D`` (Eq. 5) made safe to invert.

    Norms below ``eps * max(norms)`` are raised to that floor (an input feature that never fired
    gets the smallest weight, not an infinite ``D⁻¹``). If every norm is zero (no signal at all),
    ``D = I`` and AWSVD reduces to plain SVD. Negative or non-finite norms raise ``ValueError``.
    """
    norms = input_norms.detach()
    if norms.dim() != 1:
        raise ValueError(f"input_norms must be a vector, got shape {tuple(norms.shape)}")
    if not torch.isfinite(norms).all() or (norms < 0).any():
        raise ValueError(
            "input_norms must be finite and non-negative (pass ||X_j||_2, e.g. InputNormAccumulator.norms())"
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    top = norms.max()
    if top <= 0:
        return torch.ones_like(norms)
    return norms.clamp_min(top * eps)


def activation_weighted_svd(
    weight: torch.Tensor,
    input_norms: torch.Tensor,
    rank: int,
    *,
    eps: float = DEFAULT_EPS,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWSVD (LoRAP Eqs. 5–7): the rank-``rank`` ``L @ R`` minimising ``||(W − L R) D||``.

    ``input_norms[j] = ||X_j||₂`` is the ℓ2 norm of input feature ``j`` over all calibration tokens
    (Eq. 5), length ``d_in``. With ``D = diag(input_norms)`` (floored by :func:`clamp_norms`):
    ``SVD(W D) = U Σ Vᵀ``, ``L = U_r Σ_r``, ``R = V_rᵀ D⁻¹`` (the closed form below Eq. 7).
    Returns ``(L, R)`` in ``weight``'s dtype and device. Constant norms give plain SVD.
    """
    _check_rank(weight, rank)
    if input_norms.shape != (weight.shape[1],):
        raise ValueError(
            f"input_norms must have d_in={weight.shape[1]} entries for a {tuple(weight.shape)} weight, "
            f"got shape {tuple(input_norms.shape)}"
        )
    dtype = compute_dtype or math_dtype(weight.dtype)
    d = clamp_norms(input_norms.to(device=weight.device, dtype=dtype), eps)
    work = weight.detach().to(dtype)
    left, right = _svd_factors(work * d[None, :], rank)
    right = right / d[None, :]
    return left.to(weight.dtype), right.to(weight.dtype)


def _whitening_factor(gram: torch.Tensor, damping: float) -> torch.Tensor:
    """The lower Cholesky factor ``S`` of ``G + λI`` (float64); ``ValueError`` when no damping makes it definite."""
    # Imported here: the reconstruct family imports projection, which imports lowrank.module (a cycle at import time).
    from slimkit.primitives.reconstruct.solve import damped_cholesky

    factor, _g, info = damped_cholesky(gram, damping)
    if factor is None:
        raise ValueError(f"the Gram matrix is not positive definite even with damping {info.damping:g}")
    return factor


def whitened_svd(
    weight: torch.Tensor, gram: torch.Tensor, rank: int, *, damping: float = WHITEN_DAMPING
) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD-LLM's whitened SVD: the rank-``rank`` ``L @ R`` minimising ``||(W − L R) X||_F`` for ``G = X Xᵀ``.

    ``gram`` is ``Σ_t x_t x_tᵀ`` of the layer's calibration inputs (``d_in x d_in``). ``G + λI = S Sᵀ``
    (lower Cholesky factor, ``λ = damping · mean(diag G)``, escalated x10 when ``G`` is singular, as
    every refit does: :func:`~slimkit.primitives.reconstruct.solve.damped_cholesky`), ``SVD(W S) = U Σ Vᵀ``,
    ``L = U_r Σ_r``, ``R = V_rᵀ S⁻¹`` (a triangular solve, never an explicit inverse). Computed in float64 on
    ``gram``'s device; ``(L, R)`` come back in ``weight``'s dtype and device. A Gram no damping makes positive
    definite (non-finite entries) raises ``ValueError``."""
    _check_rank(weight, rank)
    if gram.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"gram must be d_in x d_in = {weight.shape[1]} x {weight.shape[1]} for a {tuple(weight.shape)} weight, "
            f"got shape {tuple(gram.shape)}"
        )
    factor = _whitening_factor(gram, damping)
    w = weight.detach().to(device=factor.device, dtype=torch.float64)
    left, right_white = _svd_factors(w @ factor, rank)
    # R = V_rᵀ S⁻¹  <=>  Sᵀ Rᵀ = V_r (Sᵀ is upper triangular).
    right = torch.linalg.solve_triangular(factor.T, right_white.T, upper=True).T
    return left.to(device=weight.device, dtype=weight.dtype), right.to(device=weight.device, dtype=weight.dtype)


def singular_energies(
    weight: torch.Tensor,
    input_norms: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    *,
    eps: float = DEFAULT_EPS,
    damping: float = WHITEN_DAMPING,
) -> torch.Tensor:
    """Squared singular values (descending, float64, on the CPU) of the matrix each factorisation truncates: ``W``
    (SVD), ``W D`` (AWSVD, ``D = diag(input_norms)`` floored as :func:`clamp_norms` does) or ``W S`` (whitened SVD,
    ``G + λI = S Sᵀ``). ``energies[r:].sum()`` is the squared error that method leaves at rank ``r``: plain
    ``||W − L R||²``, Eq. 7's ``||(W − L R) D||²``, or the calibration output error ``||(W − L R) X||²``."""
    if gram is not None and input_norms is not None:
        raise ValueError("give input_norms (AWSVD) or gram (whitened SVD), not both")
    work = weight.detach().to(torch.float64)
    if gram is not None:
        factor = _whitening_factor(gram, damping)
        work = work.to(factor.device) @ factor
    elif input_norms is not None:
        work = work * clamp_norms(input_norms.to(device=work.device, dtype=torch.float64), eps)[None, :]
    return torch.linalg.svdvals(work).square().cpu()


def weighted_error(
    weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, input_norms: torch.Tensor | None = None
) -> float:
    """``||(W − L R) D||_F`` (Eq. 7's objective, Frobenius); ``D = I`` when ``input_norms`` is None."""
    residual = weight.double() - left.double() @ right.double()
    if input_norms is not None:
        residual = residual * input_norms.double().to(residual.device)[None, :]
    return float(torch.linalg.matrix_norm(residual))


__all__ = [
    "DEFAULT_EPS",
    "activation_weighted_svd",
    "clamp_norms",
    "singular_energies",
    "truncated_svd",
    "weighted_error",
    "whitened_svd",
]
