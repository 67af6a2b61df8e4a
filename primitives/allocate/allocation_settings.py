"""The settings of an allocation, declared once: how a layer-wise removal shares one budget among its layers.

A stage's ``allocation`` argument is ``uniform`` (every eligible layer loses the same fraction; the default),
``{global: {...}}`` (:class:`GlobalSettings`: one ranking of every layer's units after per-layer standardisation,
:func:`slimkit.primitives.allocate.ranking.global_ranking`) or ``{search: {...}}`` (:class:`SearchSettings`: an
evolutionary search over per-layer levels, :func:`slimkit.primitives.allocate.search.search_levels`).
:func:`parse_allocation` turns the argument into one of these; a bad one raises ``ValueError`` with the field and
what is allowed.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from slimkit.primitives.errors import format_validation_error, unknown
from slimkit.primitives.settings import Strict

LEVEL_LADDERS: dict[str, tuple[float, ...]] = {
    "tenths": tuple(round(0.1 * i, 2) for i in range(10)),
    "twentieths": tuple(round(0.05 * i, 2) for i in range(20)),
    "quarters": (0.0, 0.25, 0.5, 0.75),
}
"""Named level ladders: the removal fractions a layer's group may take in a search (level 0 keeps it dense)."""
ALLOCATIONS: tuple[str, ...] = ("uniform", "global", "search")
"""The allocation names a stage's ``allocation`` argument accepts."""


class GlobalSettings(Strict):
    """One allocation over every layer at once: FLAP's (every unit's score standardised within its layer and kind, all
    units ranked on that one scale, the lowest removed until the budget's parameters are reached, each unit weighted
    by its parameters) or, with ``by: refit_error``, the counts with the least total relative refit error."""

    max_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """The largest fraction of a group's units any layer may lose (1.0: only min_keep limits it)."""
    by: Literal["score", "refit_error"] = "score"
    """What the layers' shares are decided by: ``score`` (FLAP: the stage's unit scores standardised per layer, ranked
    on one scale) or ``refit_error`` (each layer's least-squares refit error of the units' consumer, down_proj or
    o_proj, relative to its output, at every allowed kept count; the least total error per parameter removed:
    :mod:`slimkit.primitives.allocate.refit_error`)."""


class SearchSettings(Strict):
    """EvoPress's search: per-layer levels from a fixed ladder, mutated so the removed parameters stay on the budget,
    each candidate scored by the KL divergence of its next-token distribution against the dense model's on held-out
    calibration tokens (lower is better)."""

    budget_s: float = Field(120.0, allow_inf_nan=False)
    """Seconds the search may spend evaluating candidates (> 0)."""
    max_evals: int = Field(200, ge=1)
    """Most candidate evaluations; a search that ends by this count (not by time) is the same for the same seed."""
    seed: int = Field(0, ge=0)
    """Seed of the mutations."""
    levels: str | list[float] = "tenths"
    """The level ladder: a name (tenths, twentieths, quarters) or increasing removal fractions in [0, 1) from 0."""
    holdout_batches: int = Field(1, ge=1)
    """Calibration batches (the last ones) held out from scoring to measure each candidate's KL divergence."""
    offspring: int = Field(8, ge=1)
    """Candidates per generation; the best of them and the parent is the next parent."""

    @field_validator("budget_s")
    @classmethod
    def _positive_budget(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0 seconds (got {value:g}); a search needs time to evaluate candidates")
        return value

    @field_validator("levels")
    @classmethod
    def _known_ladder(cls, value: str | list[float]) -> str | list[float]:
        if isinstance(value, str):
            if value not in LEVEL_LADDERS:
                raise ValueError(unknown("level ladder", value, LEVEL_LADDERS))
            return value
        if len(value) < 2 or value[0] != 0.0 or any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError("a level list must start at 0 and increase, with at least two levels")
        if value[-1] >= 1.0:
            raise ValueError(f"levels must be below 1 (got {value[-1]:g}); 1 would remove a whole group")
        return value

    def ladder(self) -> tuple[float, ...]:
        return LEVEL_LADDERS[self.levels] if isinstance(self.levels, str) else tuple(self.levels)


Allocation = str | GlobalSettings | SearchSettings
"""A parsed allocation: ``"uniform"``, or the settings of a global ranking or a search."""


def parse_allocation(value: str | dict[str, Any]) -> Allocation:
    """``uniform``, ``global`` / ``search`` (their default settings), ``{global: {...}}`` or ``{search: {...}}`` as
    settings; ``ValueError`` (one line) otherwise."""
    models: dict[str, type[GlobalSettings | SearchSettings]] = {"global": GlobalSettings, "search": SearchSettings}
    if isinstance(value, str):
        if value not in ALLOCATIONS:
            raise ValueError(unknown("allocation", value, ALLOCATIONS))
        return value if value == "uniform" else models[value]()
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError("give one of uniform, {global: {...}} or {search: {...}}")
    ((name, settings),) = value.items()
    if name not in models:
        raise ValueError(unknown("allocation", str(name), ALLOCATIONS))
    try:
        return models[name].model_validate(settings or {})
    except ValidationError as error:
        raise ValueError(format_validation_error(error, prefix=str(name))) from None


__all__ = ["ALLOCATIONS", "LEVEL_LADDERS", "Allocation", "GlobalSettings", "SearchSettings", "parse_allocation"]
