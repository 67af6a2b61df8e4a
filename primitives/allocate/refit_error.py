"""Allocation by the refit's own error: each layer's kept count chosen by what removing its units costs after the
least-squares refit of their consumer, relative to that consumer's output.

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

import itertools
import math

import torch

from slimkit.primitives.allocate.ranking import UnitCosts, total_removed
from slimkit.primitives.allocate.steps import BudgetStep, take_cheapest
from slimkit.primitives.select.plan import TargetOutOfReach


def prefix_refit_errors(
    weight: torch.Tensor, gram: torch.Tensor, unit_columns: torch.Tensor, order: torch.Tensor, jitter: float = 1e-6
) -> torch.Tensor:
    """``errors[k]``, ``k = 0..units``: the squared output error of the consumer ``weight`` (``d_out x n``) refitted
    by least squares from the input columns of the first ``k`` units of ``order``, each output dimension's error
    over that dimension's energy, averaged over the dimensions (so ``errors[0] = 1`` and ``errors[units] = 0`` up to
    the ridge; output dimensions the consumer never writes are left out).

    ``unit_columns`` is ``[units, per_unit]``: the consumer's input columns each unit occupies; ``order`` the units,
    the one kept longest first. Columns no unit occupies are always kept (they come first)."""
    units = unit_columns.shape[0]
    if order.numel() != units or sorted(order.tolist()) != list(range(units)):
        raise ValueError(f"order must be a permutation of the {units} units")
    g = gram.detach().double()  # on the Gram's device (a GPU's Cholesky at 8B widths), the curve returned on CPU
    w = weight.detach().to(g.device, torch.float64)
    if g.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"gram {tuple(g.shape)} does not match the weight's {w.shape[1]} inputs")
    columns = unit_columns.to(g.device)
    occupied = torch.zeros(w.shape[1], dtype=torch.bool, device=g.device)
    occupied[columns.flatten()] = True
    free = torch.nonzero(~occupied).flatten()
    permutation = torch.cat([free, columns[order.to(g.device)].flatten()])
    g = g[permutation[:, None], permutation]  # one copy (ours: the ridge goes onto its diagonal in place)
    scale = float(g.diagonal().mean())
    if not math.isfinite(scale):
        raise ValueError("the consumer's input Gram has non-finite entries (NaN/inf activations)")
    if scale <= 0:  # the consumer reads nothing but zeros: removing any unit loses nothing
        return torch.zeros(units + 1, dtype=torch.float64)
    factor = _cholesky(g, jitter * scale)
    energies = (w[:, permutation] @ factor).pow(2)  # [d_out, n]: each output dimension's share per input column
    totals = energies.sum(1, keepdim=True)
    live = totals.squeeze(1) > 0
    if not bool(live.any()):
        return torch.zeros(units + 1, dtype=torch.float64)
    shares = (energies[live] / totals[live]).mean(0)  # every output dimension weighs the same
    per_unit = shares[free.numel() :].reshape(units, -1).sum(1)
    tail = torch.cat([per_unit.flip(0).cumsum(0).flip(0), per_unit.new_zeros(1)])  # tail[k]: units k.. removed
    return tail.cpu()


def _cholesky(gram: torch.Tensor, ridge: float) -> torch.Tensor:
    """Cholesky factor of ``gram + ridge I`` (``gram``'s diagonal is raised in place: no second Gram-sized copy), the
    ridge raised tenfold (up to six times) where rounding leaves it indefinite (columns that are exact copies)."""
    added = 0.0
    for _ in range(6):
        gram.diagonal().add_(ridge - added)
        added = ridge
        factor, info = torch.linalg.cholesky_ex(gram)
        if int(info) == 0:
            return factor
        ridge *= 10.0
    raise ValueError(f"the consumer's input Gram is not positive definite even with a ridge of {added:g}")


def _hull_steps(index: int, cost: UnitCosts, errors: torch.Tensor) -> list[BudgetStep]:
    """The lower convex hull of one group's (parameters removed, relative error) over its allowed kept counts, as
    steps from the whole group."""
    points = [(cost.removed(k), float(errors[k]), k) for k in sorted(cost.allowed(), reverse=True)]
    hull: list[tuple[int, float, int]] = []
    for point in points:  # x = removed increases; keep the lower hull
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            above = (y2 - y1) * (point[0] - x1) - (point[1] - y1) * (x2 - x1)
            if above > 1e-12 * (x2 - x1) * (point[0] - x1):  # hull[-1] above the chord (not by rounding)
                hull.pop()
            else:
                break
        hull.append(point)
    return [BudgetStep(index, a[2], b[2], b[0] - a[0], max(b[1] - a[1], 0.0)) for a, b in itertools.pairwise(hull)]


def allocate_by_error(errors: list[torch.Tensor], costs: list[UnitCosts], wanted: int, tolerance: int) -> list[int]:
    """Kept units per group removing ``wanted`` parameters (at most it, at least ``wanted - tolerance``) with the
    least sum of relative refit errors (``errors[g][k]``: group ``g`` keeping ``k`` units, :func:`prefix_refit_errors`),
    each count one its group allows. Raises :class:`TargetOutOfReach` when the steps that fit cannot land."""
    if len(errors) != len(costs):
        raise ValueError(f"{len(errors)} error curves for {len(costs)} groups")
    for curve, cost in zip(errors, costs, strict=True):
        if curve.numel() != cost.size + 1:
            raise ValueError(f"an error curve needs {cost.size + 1} values (kept 0..{cost.size}), got {curve.numel()}")
    most = total_removed(costs, [min(c.allowed()) for c in costs])
    if wanted > most + tolerance:
        raise TargetOutOfReach(wanted, tolerance, most, None)
    steps = [step for i, (c, e) in enumerate(zip(costs, errors, strict=True)) for step in _hull_steps(i, c, e)]
    kept = [cost.size for cost in costs]
    removed = take_cheapest(steps, kept, wanted)
    removed = _fill(errors, costs, kept, removed, wanted)
    if removed < wanted - tolerance:
        raise TargetOutOfReach(wanted, tolerance, removed, None)
    return kept


def _fill(errors: list[torch.Tensor], costs: list[UnitCosts], kept: list[int], removed: int, wanted: int) -> int:
    """Single allowed steps (one group's next smaller count, off the hull where a hull step was too large), cheapest
    error per parameter first, while one fits under ``wanted``; ``kept`` is updated. Returns the parameters removed."""
    while True:
        best: tuple[float, int, int, int] | None = None
        for i, (cost, curve) in enumerate(zip(costs, errors, strict=True)):
            smaller = [k for k in cost.allowed() if k < kept[i]]
            if not smaller:
                continue
            step = cost.removed(smaller[-1]) - cost.removed(kept[i])
            if removed + step > wanted:
                continue
            slope = max(float(curve[smaller[-1]] - curve[kept[i]]), 0.0) / step
            if best is None or slope < best[0]:
                best = (slope, i, smaller[-1], step)
        if best is None:
            return removed
        _slope, i, count, step = best
        kept[i] = count
        removed += step


__all__ = ["allocate_by_error", "prefix_refit_errors"]
