"""Global rank allocation: one parameter budget shared among many matrices by their weighted-SVD spectra.

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slimkit.primitives.allocate.steps import BudgetStep, take_cheapest
from slimkit.primitives.lowrank.rank_budget import dense_params, lowrank_params


@dataclass(frozen=True)
class MatrixSpectrum:
    """One matrix as the allocation sees it: its shape, the squared singular values its factorisation truncates
    (descending) and the ranks it may take (``max_rank`` 0: it stays dense)."""

    d_out: int
    d_in: int
    energies: torch.Tensor
    max_rank: int
    min_rank: int = 1

    def saved(self, rank: int | None) -> int:
        """Parameters saved at ``rank`` (None: dense, 0 saved)."""
        return 0 if rank is None else dense_params(self.d_in, self.d_out) - lowrank_params(self.d_in, self.d_out, rank)


class RankBudgetOutOfReach(ValueError):
    """No allocation of the ranks saves the wanted parameters (``most``: every matrix at its lowest rank)."""

    def __init__(self, wanted: int, most: int) -> None:
        super().__init__(f"the matrices save at most {most:,} parameters at their lowest ranks; {wanted:,} wanted")
        self.wanted, self.most = wanted, most


def most_saved(d_out: int, d_in: int, max_rank: int, min_rank: int) -> int:
    """Parameters a ``d_out x d_in`` matrix saves at its lowest allowed rank (0 when no rank is allowed)."""
    if not 1 <= min_rank <= min(max_rank, d_out, d_in):
        return 0
    return dense_params(d_in, d_out) - lowrank_params(d_in, d_out, min_rank)


def min_rank_for(d_out: int, d_in: int, max_fraction: float) -> int:
    """The lowest rank removing at most ``max_fraction`` of a ``d_out x d_in`` matrix's parameters (at least 1)."""
    if not 0.0 < max_fraction <= 1.0:
        raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction}")
    kept = (1.0 - max_fraction) * dense_params(d_in, d_out)
    return max(1, math.ceil(kept / (d_in + d_out) - 1e-9))


def relative_tail(energies: torch.Tensor) -> torch.Tensor:
    """``tail[r] = sum(energies[r:]) / sum(energies)`` for ``r`` in ``0..len`` (float64; zeros for a zero matrix)."""
    values = energies.detach().double().cpu().flatten()
    total = values.sum()
    tail = torch.cat([values.flip(0).cumsum(0).flip(0), values.new_zeros(1)])
    return tail / total if total > 0 else torch.zeros_like(tail)


def hull_steps(index: int, spectrum: MatrixSpectrum) -> list[BudgetStep]:
    """The lower convex hull of one matrix's (parameters saved, relative error) options, as steps from dense (state
    None) to ranks: ``end`` the rank, ``amount`` the parameters the step saves, ``cost`` the relative error it adds."""
    low, high = spectrum.min_rank, min(spectrum.max_rank, spectrum.energies.numel())
    if high < 1 or low > high:
        return []
    tail = relative_tail(spectrum.energies)
    ranks = torch.arange(low, high + 1)
    saved = torch.tensor([spectrum.saved(int(r)) for r in ranks], dtype=torch.float64)
    # the rank where the first step (dense -> r) costs least per parameter; ties: the lowest rank (saves most)
    first = int(torch.argmin(tail[ranks] / saved))
    best = int(ranks[first])
    steps = [BudgetStep(index, None, best, int(saved[first]), float(tail[best]))]
    width = spectrum.d_in + spectrum.d_out
    for rank in range(best - 1, low - 1, -1):
        steps.append(BudgetStep(index, rank + 1, rank, width, float(tail[rank] - tail[rank + 1])))
    return steps


def allocate_ranks(spectra: list[MatrixSpectrum], wanted: int, tolerance: int = 0) -> list[int | None]:
    """Each matrix's rank (None: dense) so that the parameters saved land on ``wanted`` (at most it, and at least
    ``wanted − tolerance``) with the least total relative error, cheapest hull step first.

    Raises :class:`RankBudgetOutOfReach` when even every matrix at its lowest rank saves less than
    ``wanted − tolerance``, and ``ValueError`` when the steps that fit cannot come within ``tolerance``."""
    if wanted < 0 or tolerance < 0:
        raise ValueError(f"wanted and tolerance must be >= 0 (got {wanted}, {tolerance})")
    most = sum(most_saved(s.d_out, s.d_in, min(s.max_rank, s.energies.numel()), s.min_rank) for s in spectra)
    if most < wanted - tolerance:
        raise RankBudgetOutOfReach(wanted, most)
    steps = [step for i, spectrum in enumerate(spectra) for step in hull_steps(i, spectrum)]
    ranks: list[int | None] = [None] * len(spectra)
    saved = take_cheapest(steps, ranks, wanted)
    if saved < wanted - tolerance:
        raise ValueError(
            f"the rank steps land at {saved:,} parameters saved, more than the tolerance {tolerance:,} below {wanted:,}"
        )
    return ranks


def saved_params(spectra: list[MatrixSpectrum], ranks: list[int | None]) -> int:
    return sum(s.saved(r) for s, r in zip(spectra, ranks, strict=True))


__all__ = [
    "MatrixSpectrum",
    "RankBudgetOutOfReach",
    "allocate_ranks",
    "hull_steps",
    "min_rank_for",
    "most_saved",
    "relative_tail",
    "saved_params",
]
