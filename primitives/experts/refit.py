"""Least-squares refit of the routed experts' down projections after channels inside them are removed.

A MoE layer adds ``sum_e w_e(x) D_e a_e(x)``, so the part of its output that expert ``e`` loses when only channels
``K`` stay is ``sum over its tokens of w_e^2 ||D_e a - D'_e a_K||^2``: a least-squares problem in ``D'_e`` whose
statistics are the routing-weighted Gram ``G_e = sum w_e^2 a a^T`` (:attr:`~slimkit.primitives.calibration.
routing.ExpertRouting.gram`). Each expert is refitted with :func:`~slimkit.primitives.reconstruct.least_squares.
refit_least_squares`, the ridge pulling towards the sliced columns (``toward_kept``): directions the expert's tokens
never reach keep the sliced weights instead of shrinking to zero, and the refit's error on the calibration tokens is
never above plain slicing's. An expert whose Gram is zero (no token reached it) is only sliced. The errors before
and after come from the Gram alone (``tr(D G Dᵀ) - 2 tr(D' G[K, :] Dᵀ) + tr(D' G[K, K] D'ᵀ)``).
Method note: ``docs/methods/moe-experts.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimkit.primitives.reconstruct.least_squares import refit_least_squares
from slimkit.primitives.reconstruct.solve import DEFAULT_DAMPING


@dataclass(frozen=True)
class ExpertDownRefit:
    """A layer's refitted down projections and, per expert, what the refit did."""

    down: torch.Tensor
    """``(experts, hidden, keep)`` in the input's dtype and device."""
    damping: list[float | None]
    """The relative damping each expert's solve used (after any escalation); None where the expert was sliced only."""
    error_sliced: torch.Tensor
    """``(experts,)`` float64: each expert's routing-weighted squared error on the calibration tokens, sliced."""
    error_refit: torch.Tensor
    """``(experts,)`` float64: the same after the refit (equal to ``error_sliced`` where sliced only)."""
    energy: torch.Tensor
    """``(experts,)`` float64: each expert's routing-weighted squared output ``sum w^2 ||D a||^2``."""

    @property
    def sliced_only(self) -> list[int]:
        """Experts left unrefitted (their Gram was zero: no token reached them)."""
        return [e for e, d in enumerate(self.damping) if d is None]

    def relative_error(self, refitted: bool) -> float:
        """Summed error over the summed energy of the layer's experts (0 when no expert saw a token)."""
        total = float(self.energy.sum())
        error = self.error_refit if refitted else self.error_sliced
        return float(error.sum()) / total if total > 0 else 0.0


class _ExpertError:
    """One expert's Gram in float64 and ``D G``, from which the error of any ``D'`` on channels ``K`` follows."""

    def __init__(self, down: torch.Tensor, gram: torch.Tensor, kept: torch.Tensor) -> None:
        self.gram = gram.double()
        self.kept = kept.to(self.gram.device)
        down_gram = down.to(device=self.gram.device, dtype=torch.float64) @ self.gram
        self.energy = float((down_gram * down.to(down_gram)).sum())
        self.cross = down_gram[:, self.kept]  # D G[:, K] (G is symmetric)

    def __call__(self, new_down: torch.Tensor) -> float:
        new = new_down.to(device=self.gram.device, dtype=torch.float64)
        fitted = (new @ self.gram[self.kept][:, self.kept] * new).sum()
        return max(0.0, float(self.energy - 2 * (self.cross * new).sum() + fitted))


def weighted_error(down: torch.Tensor, gram: torch.Tensor, new_down: torch.Tensor, kept: torch.Tensor) -> float:
    """``sum w^2 ||D a - D' a_K||^2`` of one expert from its Gram ``G`` (``width x width``) alone: ``D`` is
    ``hidden x width``, ``D'`` ``hidden x |K|``."""
    return _ExpertError(down, gram, kept)(new_down)


def refit_expert_down(
    down: torch.Tensor, grams: torch.Tensor, index: torch.Tensor, *, damping: float = DEFAULT_DAMPING
) -> ExpertDownRefit:
    """Refit every expert's down projection ``down`` ``(experts, hidden, width)`` on its kept channels ``index``
    ``(experts, keep)`` from its routing-weighted Gram ``grams`` ``(experts, width, width)``."""
    experts, hidden, width = down.shape
    if grams.shape != (experts, width, width):
        raise ValueError(
            f"grams must be {(experts, width, width)} for down {tuple(down.shape)}, got {tuple(grams.shape)}"
        )
    if index.dim() != 2 or index.shape[0] != experts or not 1 <= index.shape[1] <= width:
        raise ValueError(f"index must be (experts={experts}, keep in 1..{width}), got {tuple(index.shape)}")
    out = torch.empty(experts, hidden, index.shape[1], dtype=down.dtype, device=down.device)
    dampings: list[float | None] = []
    before, after, energy = (torch.zeros(experts, dtype=torch.float64) for _ in range(3))
    for e in range(experts):
        kept = index[e].to(torch.long).cpu()
        sliced = down[e][:, kept.to(down.device)]
        gram = grams[e]
        if not bool(gram.diagonal().abs().sum() > 0):
            out[e] = sliced
            dampings.append(None)
            continue
        fitted = refit_least_squares(down[e], gram, kept, damping=damping, toward_kept=True)
        out[e] = fitted.weight
        dampings.append(fitted.damping)
        error = _ExpertError(down[e], gram, kept)
        energy[e], before[e], after[e] = error.energy, error(sliced), error(fitted.weight)
    return ExpertDownRefit(out, dampings, before, after, energy)


__all__ = ["ExpertDownRefit", "refit_expert_down", "weighted_error"]
