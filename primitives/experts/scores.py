"""Choosing which routed experts a layer keeps.

* Router statistics (:mod:`slimkit.primitives.calibration.routing`): ``frequency`` (tokens routed to each expert)
  and ``weight`` (its mean top-k routing weight, the routing mass): keep the experts with the largest.
* NAEE (Lu et al. 2024, "Not All Experts are Equal", Sec. 3.1): keep the set ``S`` of experts minimising the
  reconstruction loss of the layer's routed output on calibration tokens, ``||F(x) - F_S(x)||^2 / ||F(x)||^2``, with
  ``F_S`` the layer when only ``S`` is routable (:func:`slimkit.primitives.experts.routed.routing`). Every kept
  set of the size is tried when there are at most ``max_candidates`` of them (the paper's enumeration); otherwise a
  greedy search removes, one at a time, the expert whose removal raises the loss least. Every expert's output on the
  tokens is computed once, so a candidate costs one gather.

Each search also gives the layer's loss curve (the loss after each greedy removal), which the per-layer allocation
(:func:`allocate_removals`) compares across layers.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from slimkit.primitives.calibration.routing import ExpertRouting
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts.routed import ExpertWeights, combine, expert_outputs, routing
from slimkit.primitives.experts.routers import balanced_keep_top, check_groups

ExpertScorer = Literal["frequency", "weight", "naee"]
EXPERT_SCORERS: tuple[ExpertScorer, ...] = ("frequency", "weight", "naee")


def router_scores(stats: ExpertRouting, scorer: ExpertScorer) -> torch.Tensor:
    """One score per expert (higher: keep) from the routing statistics."""
    if scorer == "frequency":
        return stats.frequency.double()
    if scorer == "weight":
        return stats.mean_weight.double()
    raise ValueError(f"{scorer} is not a router-statistics scorer")


def keep_top(scores: torch.Tensor, keep: int, groups: int = 1) -> list[int]:
    """The ``keep`` highest-scoring experts, sorted by index (ties: the lower index); ``groups`` > 1: the same number
    in each of that many equal groups (a group-limited router)."""
    if groups > 1:
        return balanced_keep_top(scores, keep, groups)
    order = sorted(range(scores.numel()), key=lambda e: (-float(scores[e]), e))
    return sorted(order[:keep])


def dropped_share_curve(scores: torch.Tensor) -> list[float]:
    """Share of the total score removed after dropping the 0, 1, 2, ... lowest-scoring experts."""
    ordered = sorted(float(s) for s in scores)
    total = sum(ordered) or 1.0
    return [sum(ordered[:n]) / total for n in range(len(ordered) + 1)]


@dataclass
class KeptSearch:
    """The result of a kept-set search in one layer."""

    kept: list[int]
    loss: float
    """Relative squared error of the routed output with only ``kept`` routable."""
    candidates: int
    """Kept sets whose loss was measured."""
    exhaustive: bool
    curve: list[float] = field(default_factory=list)
    """Loss after 0, 1, 2, ... greedy removals (as far as the search went)."""


class KeptSetLoss:
    """The reconstruction loss of the routed output on tokens ``x`` for any kept set (every expert's output cached)."""

    def __init__(self, weights: ExpertWeights, x: torch.Tensor) -> None:
        self.weights = weights
        self.x = x
        self.outputs = expert_outputs(weights, x)
        index, top = routing(weights, x)
        self.dense = combine(self.outputs, index, top)
        self.norm = float(self.dense.pow(2).sum()) or 1.0
        self.measured = 0

    def __call__(self, kept: Sequence[int]) -> float:
        mask = torch.zeros(self.weights.num_experts, dtype=torch.bool, device=self.x.device)
        mask[list(kept)] = True
        index, top = routing(self.weights, self.x, mask)
        self.measured += 1
        return float((combine(self.outputs, index, top) - self.dense).pow(2).sum()) / self.norm


def _droppable(kept: list[int], experts: int, groups: int) -> list[int]:
    """The experts one greedy step may drop: under a group-limited router only from the groups that keep the most,
    so every ``groups`` removals leave each group the same count."""
    if groups <= 1:
        return kept
    size = experts // groups
    counts = {g: sum(1 for e in kept if e // size == g) for g in range(groups)}
    most = max(counts.values())
    return [e for e in kept if counts[e // size] == most]


def greedy_curve(loss: KeptSetLoss, down_to: int) -> tuple[list[list[int]], list[float]]:
    """Kept sets and losses after 0, 1, ... greedy removals, down to ``down_to`` experts (under a group-limited
    router, removals taken from the fullest groups)."""
    kept = list(range(loss.weights.num_experts))
    groups = loss.weights.rule.groups
    sets, curve = [list(kept)], [0.0]
    while len(kept) > down_to:
        trials = [(loss([e for e in kept if e != drop]), drop) for drop in _droppable(kept, len(sets[0]), groups)]
        best, drop = min(trials)
        kept.remove(drop)
        sets.append(list(kept))
        curve.append(best)
    return sets, curve


def naee_search(
    weights: ExpertWeights, x: torch.Tensor, keep: int, *, max_candidates: int = 5000, curve_to: int | None = None
) -> KeptSearch:
    """NAEE's kept set of ``keep`` experts on tokens ``x`` ``(tokens, hidden)``: exhaustive when at most
    ``max_candidates`` sets exist, else greedy. ``curve_to``: also trace the greedy curve down to that many experts."""
    loss = KeptSetLoss(weights, x)
    experts = weights.num_experts
    down_to = min(keep, curve_to if curve_to is not None else keep)
    exhaustive = math.comb(experts, keep) <= max_candidates
    sets, curve = greedy_curve(loss, down_to) if curve_to is not None or not exhaustive else ([], [])
    if exhaustive:
        candidates = [list(s) for s in itertools.combinations(range(experts), keep)]
        if weights.rule.groups > 1:  # a group-limited router keeps the same count in every group
            candidates = [c for c in candidates if check_groups(weights.rule, c) is None]
            if not candidates:
                raise SlimkitError(
                    f"{keep} of {experts} experts cannot be kept by a router over {weights.rule.groups} groups "
                    f"(n_group): every group keeps the same number, at least 2"
                )
        best = min((loss(c), c) for c in candidates)
        return KeptSearch(best[1], best[0], loss.measured, True, curve)
    chosen = sets[experts - keep]
    return KeptSearch(sorted(chosen), curve[experts - keep], loss.measured, False, curve)


def allocate_removals(curves: Mapping[int, Sequence[float]], total: int, max_remove: dict[int, int]) -> dict[int, int]:
    """Experts each layer loses so that ``total`` go in all, taking the cheapest next removal each time (by each
    layer's loss curve: ``curve[n]`` the loss after ``n`` removals); a layer loses at most ``max_remove[layer]``."""
    removed = dict.fromkeys(curves, 0)
    heap = [(curves[i][1] - curves[i][0], i) for i in curves if max_remove[i] > 0 and len(curves[i]) > 1]
    heapq.heapify(heap)
    for _ in range(total):
        if not heap:
            raise ValueError(f"only {sum(removed.values())} experts can go, not {total}")
        _, layer = heapq.heappop(heap)
        removed[layer] += 1
        n = removed[layer]
        if n < max_remove[layer] and n + 1 < len(curves[layer]):
            heapq.heappush(heap, (curves[layer][n + 1] - curves[layer][n], layer))
    return removed


__all__ = [
    "EXPERT_SCORERS",
    "ExpertScorer",
    "KeptSearch",
    "KeptSetLoss",
    "allocate_removals",
    "dropped_share_curve",
    "greedy_curve",
    "keep_top",
    "naee_search",
    "router_scores",
]
