"""Allocation: how one budget of removed parameters is shared among layers and unit kinds, by measurement.

* :mod:`.ranking`: FLAP's global ranking (per-layer standardised scores on one scale, per-unit parameter costs,
  alignment multiples and minimums) landing on a number of parameters removed (:func:`global_ranking`).
* :mod:`.search`: EvoPress's evolutionary search over per-layer levels with the total held on the budget
  (:func:`search_levels`).
* :mod:`.fitness`: the search's fitness, the KL divergence of a candidate against cached dense log-probabilities
  (:func:`mean_kl`), and candidates assembled by masking units (:func:`masked_units`).
* :mod:`.refit_error`: kept counts by the least-squares refit error of the units' consumer at every count
  (:func:`~.refit_error.prefix_refit_errors`, :func:`~.refit_error.allocate_by_error`; ``by: refit_error``).
* :mod:`.steps`: the cheapest-first sweep over items' hull steps under one budget (:func:`~.steps.take_cheapest`).
* :mod:`.settings`: a stage's ``allocation`` argument (:func:`parse_allocation`).

Method note: docs/methods/allocation.md.
"""

from __future__ import annotations

from slimkit.primitives.allocate.allocation_settings import (
    ALLOCATIONS,
    LEVEL_LADDERS,
    Allocation,
    GlobalSettings,
    SearchSettings,
    parse_allocation,
)
from slimkit.primitives.allocate.fitness import consumer_masks, dense_log_probs, masked_units, mean_kl
from slimkit.primitives.allocate.ranking import UnitCosts, global_ranking, standardize, total_removed, unit_costs
from slimkit.primitives.allocate.search import SearchResult, SearchTrace, search_levels, uniform_start

__all__ = [
    "ALLOCATIONS",
    "LEVEL_LADDERS",
    "Allocation",
    "GlobalSettings",
    "SearchResult",
    "SearchSettings",
    "SearchTrace",
    "UnitCosts",
    "consumer_masks",
    "dense_log_probs",
    "global_ranking",
    "masked_units",
    "mean_kl",
    "parse_allocation",
    "search_levels",
    "standardize",
    "total_removed",
    "uniform_start",
    "unit_costs",
]
