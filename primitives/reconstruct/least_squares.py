"""Least-squares refit of a consumer matrix from the inputs that remain after units are removed.

When input units of a consumer ``W`` (``d_out x d_in``) are removed (MLP channels: columns of
``down_proj``; heads: blocks of columns of ``o_proj``), the kept columns ``K`` can be refitted so
the layer's output on calibration data stays as close as possible to the dense output:

    W' = argmin_{W'} ||W X − W' X_K||_F² + λ ||W'||_F²
       = W G[:, K] (G[K, K] + λI)⁻¹,          G = X Xᵀ,

(normal equations: ``W' (X_K X_Kᵀ + λI) = W X X_Kᵀ``). :func:`refit_least_squares` computes it from
the streamed Gram matrix alone.

:func:`refit_to_dense` is the variant for inputs that differ from the dense ones, e.g. inside a
``sequential`` run, where the consumer's input ``X_c`` comes from the already compressed layers
while the target is the dense model's output ``W X_d`` on the same tokens:

    W' = argmin ||W X_d − W' X_c,K||² + λ||W'||² = W C[:, K] (G_c[K, K] + λI)⁻¹,
    C = X_d X_cᵀ (cross term, d_in x d_in_c),   G_c = X_c X_cᵀ.

Choices recorded here:

* ``λ = damping · mean(diag(G[K, K]))`` (relative, so the token count does not matter); the default
  :data:`~.solve.DEFAULT_DAMPING` is tiny because this ridge pulls ``W'`` towards zero (see there).
  Cholesky solve, escalating the damping x10 on failure, then minimum-norm ``lstsq``
  (:func:`~.solve.damped_solve`); :class:`Refit` reports the damping and method used.
* Passing ``G + μI`` as the Gram with ``damping=0`` instead regularises towards the dense weight
  (``+ μ||W' − W_K||²``): that is exactly the OBS update of :mod:`.obs` with damping ``μ``.
* With nothing removed (``K`` = every column, in order) :func:`refit_least_squares` returns ``W``
  unchanged: the dense weight is the exact solution at ``λ = 0`` and the ridge is there for
  conditioning, not to shrink an intact layer.
* ``K`` keeps the caller's order: column ``i`` of ``W'`` multiplies input ``K[i]``.
* float64 on the Gram's device; ``W'`` is returned in ``W``'s dtype and on ``W``'s device.
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
    solution, info = damped_solve(rhs, g[k][:, k], damping, retries)
    if toward_kept and info.lam > 0:
        # The prior term uses the λ the solve settled on (it may have escalated the damping).
        solution, info = damped_solve(rhs + info.lam * w[:, k], g[k][:, k], info.damping, retries)
    return Refit(solution.to(device=weight.device, dtype=weight.dtype), info)


def refit_to_dense(
    weight: torch.Tensor,
    cross: torch.Tensor,
    gram: torch.Tensor,
    kept: Indices,
    *,
    damping: float = DEFAULT_DAMPING,
    retries: int = 3,
) -> Refit:
    """``W' = W C[:, K] (G_c[K, K] + λI)⁻¹``: refit against the dense output ``W X_d`` from other inputs ``X_c``.

    ``cross`` is ``C = Σ_t x_d,t x_c,tᵀ`` (``d_in x d_c``; :class:`~.gram.CrossGramAccumulator` with
    ``a`` = dense inputs, ``b`` = compressed inputs), ``gram`` is ``G_c = Σ_t x_c,t x_c,tᵀ``
    (``d_c x d_c``) and ``K`` indexes the compressed inputs' columns. ``d_c`` may differ from
    ``d_in`` (the compressed input may already be narrower). Nothing is short-circuited here: even
    with ``K`` = everything the inputs differ, so the refit changes ``W``."""
    g = symmetric(gram)
    if cross.dim() != 2 or cross.shape[1] != g.shape[0]:
        raise ValueError(f"cross must be d_in x {g.shape[0]} for a {tuple(g.shape)} Gram, got {tuple(cross.shape)}")
    _check_weight(weight, cross.shape[0], "cross term")
    k = as_indices(kept, g.shape[0], "kept").to(g.device)
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    rhs = w @ cross.detach().to(device=g.device, dtype=torch.float64)[:, k]
    solution, info = damped_solve(rhs, g[k][:, k], damping, retries)
    return Refit(solution.to(device=weight.device, dtype=weight.dtype), info)


__all__ = ["Refit", "refit_least_squares", "refit_to_dense"]
