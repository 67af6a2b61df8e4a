"""Refit the left factor of a low-rank pair against the dense output.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

import torch

from slimkit.primitives.reconstruct.least_squares import Refit
from slimkit.primitives.reconstruct.solve import DEFAULT_DAMPING, damped_solve, symmetric


def refit_left(
    weight: torch.Tensor,
    right: torch.Tensor,
    gram: torch.Tensor,
    *,
    cross: torch.Tensor | None = None,
    damping: float = DEFAULT_DAMPING,
    toward: torch.Tensor | None = None,
    retries: int = 3,
) -> Refit:
    """``L' = W G Rᵀ (R G Rᵀ + λI)⁻¹`` (``d_out x r``); with ``cross``, ``W C Rᵀ (R G Rᵀ + λI)⁻¹``.

    ``weight`` is the dense ``W`` (``d_out x d_in``), ``right`` the fixed ``R`` (``r x d_in_c``),
    ``gram`` the Gram of the inputs ``R`` sees (``d_in_c x d_in_c``), ``cross`` (optional,
    ``d_in x d_in_c``) the dense-by-those-inputs cross term. ``toward`` (optional, the current ``L``) makes the
    ridge pull towards it instead of zero, ``argmin ||W X − L' R X||² + λ||L' − L||²``, i.e.
    ``L' = (W G Rᵀ + λ L) (R G Rᵀ + λI)⁻¹``: a large λ leaves the pair as it was."""
    g = symmetric(gram)
    if right.dim() != 2 or right.shape[1] != g.shape[0]:
        raise ValueError(f"right must be r x {g.shape[0]} for a {tuple(g.shape)} Gram, got {tuple(right.shape)}")
    r = right.detach().to(device=g.device, dtype=torch.float64)
    if cross is None:
        if weight.dim() != 2 or weight.shape[1] != g.shape[0]:
            raise ValueError(f"weight must be d_out x {g.shape[0]}, got {tuple(weight.shape)}")
        target = g
    else:
        if cross.dim() != 2 or cross.shape[1] != g.shape[0] or weight.dim() != 2 or weight.shape[1] != cross.shape[0]:
            raise ValueError(
                f"expected W (d_out x d_in) and cross (d_in x {g.shape[0]}), "
                f"got {tuple(weight.shape)} and {tuple(cross.shape)}"
            )
        target = cross.detach().to(device=g.device, dtype=torch.float64)
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    rhs = w @ target @ r.T
    solution, info = damped_solve(rhs, r @ g @ r.T, damping, retries, prior=toward)
    return Refit(solution.to(device=weight.device, dtype=weight.dtype), info)


__all__ = ["refit_left"]
