"""PLATON smoothing of importance scores (Zhang et al. 2022; CCE Eq. 7), usable with any scorer.

Method note: docs/methods/cce-coupled-scores.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from slimkit.primitives.groups import Group


class Platon:
    """The Eq. 7 recurrence for one score vector; call :meth:`update` once per evaluation."""

    def __init__(self, x1: float = 0.5, x2: float = 0.5) -> None:
        if not (0.0 <= x1 < 1.0 and 0.0 <= x2 < 1.0):
            raise ValueError(f"PLATON needs 0 <= x1, x2 < 1 (got x1={x1}, x2={x2})")
        self.x1, self.x2 = x1, x2
        self.importance: torch.Tensor | None = None
        """I_bar(t)."""
        self.uncertainty: torch.Tensor | None = None
        """U_bar(t)."""
        self.score: torch.Tensor | None = None
        """S after the evaluations so far."""
        self.steps = 0

    def update(self, importance: torch.Tensor) -> torch.Tensor:
        importance = importance.detach().double()
        if self.importance is None:
            self.importance = torch.zeros_like(importance)
            self.uncertainty = torch.zeros_like(importance)
            self.score = torch.zeros_like(importance)
        elif importance.shape != self.importance.shape:
            raise ValueError(f"PLATON: {importance.shape[0]} scores after {self.importance.shape[0]}")
        self.importance = self.x1 * self.importance + (1 - self.x1) * importance
        self.uncertainty = self.x2 * self.uncertainty + (1 - self.x2) * (importance - self.importance).abs()
        self.score = self.score + self.importance * self.uncertainty
        self.steps += 1
        return self.score


class PlatonScorer:
    """Any scorer, smoothed with :class:`Platon` over repeated evaluations (e.g. calibration batches).

    ``update(groups, model, stats)`` scores every group once; ``scores(groups)`` gives S per group.
    Groups are keyed by (kind, layer), so rebuilt groups of the same shapes continue their state.
    """

    def __init__(self, scorer: str | Callable[..., torch.Tensor], x1: float = 0.5, x2: float = 0.5, **args: Any):
        self.scorer, self.args = scorer, args
        self.x1, self.x2 = x1, x2
        self.states: dict[tuple[str, int | None], Platon] = {}

    def _score(self, group: Group, model: nn.Module, stats: Mapping) -> torch.Tensor:
        if callable(self.scorer):
            return self.scorer(group, model, stats, **self.args)
        from slimkit.primitives.importance import score_group

        return score_group(self.scorer, group, model, stats, **self.args)

    def update(self, groups: list[Group], model: nn.Module, stats: Mapping) -> None:
        for group in groups:
            key = (group.kind, group.layer)
            state = self.states.setdefault(key, Platon(self.x1, self.x2))
            state.update(self._score(group, model, stats))

    def scores(self, groups: list[Group]) -> list[torch.Tensor]:
        missing = [g for g in groups if (g.kind, g.layer) not in self.states]
        if missing:
            raise ValueError(f"PLATON: no evaluation yet for {missing[0].kind} (layer {missing[0].layer})")
        return [self.states[(g.kind, g.layer)].score.float() for g in groups]


__all__ = ["Platon", "PlatonScorer"]
