"""Least-squares refit of a consumer matrix from the inputs that remain after units are removed.

The kept columns of ``down_proj`` / ``o_proj`` refitted so the layer's output on calibration data stays as close as
possible to the dense output, with a ridge.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimkit.primitives.reconstruct.error import Indices, as_indices
from slimkit.primitives.reconstruct.solve import DEFAULT_DAMPING, SolveInfo, damped_solve, symmetric


@dataclass(frozen=True)
class Refit:
    """A refitted matrix (in the original weight's dtype and device) and how its system was solved."""

    weight: torch.Tensor
    info: SolveInfo

    @property
    def damping(self) -> float:
        """The relative damping actually used (after any escalation)."""
        return self.info.damping


def _check_weight(weight: torch.Tensor, width: int, what: str) -> None:
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"weight must be d_out x {width} to match the {what}, got {tuple(weight.shape)}")


def refit_least_squares(
    weight: torch.Tensor,
    gram: torch.Tensor,
    kept: Indices,
    *,
    damping: float = DEFAULT_DAMPING,
    retries: int = 3,
    toward_kept: bool = False,
) -> Refit:
    """``W' = W G[:, K] (G[K, K] + λI)⁻¹`` (``d_out x |K|``): the refit of ``W`` on kept inputs ``K``.

    ``gram`` is ``Σ_t x_t x_tᵀ`` of the consumer's dense inputs (``d_in x d_in``). With ``toward_kept`` the
    ridge pulls towards the unrefitted kept columns instead of zero,
    ``argmin ||W X − W' X_K||² + λ||W' − W[:, K]||²``, i.e. ``W' = (W G[:, K] + λ W[:, K]) (G[K, K] + λI)⁻¹``:
    a large λ leaves the pruned weight as it was, λ → 0 is the plain refit."""
    g = symmetric(gram)
    _check_weight(weight, g.shape[0], "Gram")
    index = as_indices(kept, g.shape[0], "kept")
    if torch.equal(index, torch.arange(g.shape[0])):
        return Refit(weight.detach().clone(), SolveInfo(0.0, 0.0, "unchanged"))
    k = index.to(g.device)
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    rhs = w @ g[:, k]
    solution, info = damped_solve(rhs, g[k][:, k], damping, retries, prior=w[:, k] if toward_kept else None)
    return Refit(solution.to(device=weight.device, dtype=weight.dtype), info)


def refit_to_dense(
    weight: torch.Tensor,
    cross: torch.Tensor,
    gram: torch.Tensor,
    kept: Indices,
    *,
    damping: float = DEFAULT_DAMPING,
    retries: int = 3,
    toward_kept: bool = False,
) -> Refit:
    """``W' = W C[:, K] (G_c[K, K] + λI)⁻¹``: refit against the dense output ``W X_d`` from other inputs ``X_c``.

    ``cross`` is ``C = Σ_t x_d,t x_c,tᵀ`` (``d_in x d_c``; :class:`~.gram.CrossGramAccumulator` with
    ``a`` = dense inputs, ``b`` = compressed inputs), ``gram`` is ``G_c = Σ_t x_c,t x_c,tᵀ``
    (``d_c x d_c``) and ``K`` indexes the compressed inputs' columns. ``d_c`` may differ from
    ``d_in`` (the compressed input may already be narrower). Nothing is short-circuited here: even
    with ``K`` = everything the inputs differ, so the refit changes ``W``.

    ``toward_kept`` pulls the ridge towards ``W[:, K]`` as in :func:`refit_least_squares` (which needs
    ``d_c == d_in``): ``W' = (W C[:, K] + λ W[:, K]) (G_c[K, K] + λI)⁻¹``. With ``C = G_c`` (the same
    inputs) this is exactly :func:`refit_least_squares`'s solution."""
    g = symmetric(gram)
    if cross.dim() != 2 or cross.shape[1] != g.shape[0]:
        raise ValueError(f"cross must be d_in x {g.shape[0]} for a {tuple(g.shape)} Gram, got {tuple(cross.shape)}")
    _check_weight(weight, cross.shape[0], "cross term")
    if toward_kept and cross.shape[0] != g.shape[0]:
        raise ValueError("toward_kept needs the dense and compressed inputs to have the same width")
    k = as_indices(kept, g.shape[0], "kept").to(g.device)
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    rhs = w @ cross.detach().to(device=g.device, dtype=torch.float64)[:, k]
    solution, info = damped_solve(rhs, g[k][:, k], damping, retries, prior=w[:, k] if toward_kept else None)
    return Refit(solution.to(device=weight.device, dtype=weight.dtype), info)


@dataclass(frozen=True)
class AffineRefit:
    """A refitted weight ``W'`` (``d_out x |K|``), the bias shift ``Δb`` to add to the consumer's bias (both in the
    weight's dtype and device) and how the weight's system was solved (``"unchanged"`` when not refitted)."""

    weight: torch.Tensor
    bias_shift: torch.Tensor
    info: SolveInfo


def centred(cross: torch.Tensor, sum_a: torch.Tensor, sum_b: torch.Tensor, tokens: int) -> torch.Tensor:
    """``Σ (a − ā)(b − b̄)ᵀ = C − s_a s_bᵀ / T`` (float64): a centred Gram (``a = b``) or cross term."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    c = cross.detach().double()
    sa = sum_a.to(device=c.device, dtype=torch.float64)
    sb = sum_b.to(device=c.device, dtype=torch.float64)
    return c - torch.outer(sa, sb) / tokens


def refit_affine(
    weight: torch.Tensor,
    gram: torch.Tensor,
    input_sum: torch.Tensor,
    tokens: int,
    kept: Indices,
    *,
    cross: torch.Tensor | None = None,
    target_sum: torch.Tensor | None = None,
    refit: bool = True,
    damping: float = DEFAULT_DAMPING,
    retries: int = 3,
    toward_kept: bool = False,
) -> AffineRefit:
    """Joint refit of a consumer's kept weights and its bias (the bias is free, the ridge acts on weights only).

    ``argmin_{W', b'} ||W X_d + b 1ᵀ − W' X_c,K − b' 1ᵀ||² + λ||W' − P||²`` (``P`` = 0, or ``W[:, K]`` with
    ``toward_kept``). Minimising over ``b'`` first gives ``b' = b + W x̄_d − W' x̄_c,K``; what is left is the
    weight refit on *centred* statistics, ``G̃ = G − s sᵀ/T`` and ``C̃ = C − s_d s_cᵀ/T``. This equals the refit on
    :func:`~.gram.with_bias_column`'s augmented Gram with the constant column kept and left undamped (the
    augmented form would damp the bias too, by ``λ = damping · mean(diag)``, which outlier channels make much
    larger than ``T``: the bias would barely move). Returns ``W'`` and ``Δb = W x̄_d − W' x̄_c,K``.

    ``gram``/``input_sum``/``tokens``: ``G_c``, ``s_c``, ``T`` of the inputs the refit uses. ``cross``/``target_sum``:
    ``C = Σ x_d x_cᵀ`` and ``s_d`` of the inputs the target is computed from (None: the same inputs, ``C = G``).
    ``refit=False`` keeps ``W' = W[:, K]`` and only shifts the bias: FLAP's mean compensation, ``Δb = W[:, S] x̄_S``
    when the inputs are the same (:func:`~.bias.bias_compensation`)."""
    if (cross is None) != (target_sum is None):
        raise ValueError("give both cross and target_sum (dense-target refit) or neither")
    g = symmetric(gram)
    _check_weight(weight, g.shape[0] if cross is None else cross.shape[0], "Gram")
    k = as_indices(kept, g.shape[0], "kept")
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    s_c = input_sum.to(device=g.device, dtype=torch.float64)
    s_d = s_c if target_sum is None else target_sum.to(device=g.device, dtype=torch.float64)
    if not refit:
        solution = w[:, k.to(g.device)]
        info = SolveInfo(0.0, 0.0, "unchanged")
    elif cross is None:
        fitted = refit_least_squares(
            w, centred(g, s_c, s_c, tokens), k, damping=damping, retries=retries, toward_kept=toward_kept
        )
        solution, info = fitted.weight, fitted.info
    else:
        fitted = refit_to_dense(
            w,
            centred(cross.to(g.device), s_d, s_c, tokens),
            centred(g, s_c, s_c, tokens),
            k,
            damping=damping,
            retries=retries,
            toward_kept=toward_kept,
        )
        solution, info = fitted.weight, fitted.info
    shift = (w @ s_d - solution @ s_c[k.to(g.device)]) / tokens
    return AffineRefit(
        solution.to(device=weight.device, dtype=weight.dtype), shift.to(device=weight.device, dtype=weight.dtype), info
    )


__all__ = ["AffineRefit", "Refit", "centred", "refit_affine", "refit_least_squares", "refit_to_dense"]
