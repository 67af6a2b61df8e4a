"""Composing registered scorers: PLATON smoothing of any scorer, and weighted blends.

Method note: docs/methods/scorers.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group


@dataclass(frozen=True)
class Named:
    name: str


@dataclass(frozen=True)
class Smoothed:
    inner: ScorerSpec
    x1: float = 0.5
    x2: float = 0.5


@dataclass(frozen=True)
class Blend:
    parts: tuple[tuple[ScorerSpec, float], ...]


ScorerSpec = Named | Smoothed | Blend


def _names() -> list[str]:
    from slimkit.primitives.importance import SCORERS

    return sorted(SCORERS)


def parse_scorer(value: Any) -> ScorerSpec:
    """A :data:`ScorerSpec` from a recipe value; raises ``ValueError`` with the allowed forms."""
    from slimkit.primitives.errors import unknown

    if isinstance(value, Named | Smoothed | Blend):
        return value
    if isinstance(value, str):
        if value not in _names():
            raise ValueError(unknown("scorer", value, _names()) + ", or {platon: ...} / {blend: ...}")
        return Named(value)
    if isinstance(value, dict) and "platon" in value:
        extra = set(value) - {"platon", "x1", "x2"}
        if extra:
            raise ValueError(f"scorer platon: unknown field '{sorted(extra)[0]}'; allowed: platon, x1, x2")
        x1, x2 = value.get("x1", 0.5), value.get("x2", 0.5)
        for key, x in (("x1", x1), ("x2", x2)):
            if not isinstance(x, int | float) or not 0.0 <= x < 1.0:
                raise ValueError(f"scorer platon: {key} must be a number in [0, 1) (got {x!r})")
        inner = parse_scorer(value["platon"])
        if spec_smooths(inner):
            raise ValueError("scorer platon: the scorer inside platon is smoothed already")
        return Smoothed(inner, float(x1), float(x2))
    if isinstance(value, dict) and "blend" in value:
        if set(value) != {"blend"}:
            raise ValueError("scorer blend: a blend has the one field 'blend'")
        parts = value["blend"]
        if isinstance(parts, dict):
            items = list(parts.items())
        elif isinstance(parts, list) and all(isinstance(p, dict) and set(p) == {"scorer", "weight"} for p in parts):
            items = [(p["scorer"], p["weight"]) for p in parts]
        else:
            raise ValueError("scorer blend: give {name: weight, ...} or a list of {scorer: ..., weight: ...}")
        if not items:
            raise ValueError("scorer blend: name at least one scorer")
        parsed = []
        for inner, weight in items:
            if not isinstance(weight, int | float) or isinstance(weight, bool) or not weight > 0:
                raise ValueError(f"scorer blend: weights must be positive numbers (got {weight!r})")
            parsed.append((parse_scorer(inner), float(weight)))
        return Blend(tuple(parsed))
    raise ValueError(f"scorer: expected a scorer name ({', '.join(_names())}), {{platon: ...}} or {{blend: ...}}")


def spec_names(spec: ScorerSpec) -> list[str]:
    """The registered scorers a spec uses."""
    if isinstance(spec, Named):
        return [spec.name]
    if isinstance(spec, Smoothed):
        return spec_names(spec.inner)
    return [name for part, _w in spec.parts for name in spec_names(part)]


def spec_needs(spec: ScorerSpec) -> set[str]:
    """Statistics keys the spec's scorers read (``input_norms``, ``gradients``)."""
    from slimkit.primitives.importance import scorer_def

    return {key for name in spec_names(spec) for key in scorer_def(name).needs}


def spec_gradients(spec: ScorerSpec, model: nn.Module, groups: list[Group], args: Mapping[str, Any]):
    """The :class:`~slimkit.primitives.importance.GradientRequest` of the spec's gradient scorers for ``groups``
    (the union of tensors; squares if any part reads them); None when no part reads gradients."""
    from slimkit.primitives.importance import GradientRequest, scorer_def

    request = None
    for name in spec_names(spec):
        definition = scorer_def(name)
        if "gradients" not in definition.needs:
            continue
        if definition.gradients is None:  # an unspecified reader: every parameter, both moments
            own = GradientRequest(tuple(model.parameters()), squares=True)
        else:
            own = definition.gradients(model, groups, args)
        request = own if request is None else request.merged(own)
    return request


def spec_kinds(spec: ScorerSpec) -> set[str] | None:
    """Group kinds every scorer of the spec can score (None: any)."""
    from slimkit.primitives.importance import scorer_def

    kinds: set[str] | None = None
    for name in spec_names(spec):
        own = scorer_def(name).kinds
        if own is not None:
            kinds = set(own) if kinds is None else kinds & set(own)
    return kinds


def spec_smooths(spec: ScorerSpec) -> bool:
    """Whether the spec smooths over evaluations (so a stage should evaluate once per batch)."""
    if isinstance(spec, Smoothed):
        return True
    if isinstance(spec, Blend):
        return any(spec_smooths(part) for part, _w in spec.parts)
    return False


def describe(spec: ScorerSpec) -> str:
    """A short text for reports: ``activation``, ``platon(coupled)``, ``blend(0.5 activation + 0.5 taylor)``."""
    if isinstance(spec, Named):
        return spec.name
    if isinstance(spec, Smoothed):
        return f"platon({describe(spec.inner)})"
    return "blend(" + " + ".join(f"{w:g} {describe(p)}" for p, w in spec.parts) + ")"


def normalised(scores: torch.Tensor) -> torch.Tensor:
    """Scores divided by their mean absolute value (zeros stay zeros)."""
    scale = scores.abs().mean()
    return scores / scale if scale > 0 else scores


def score_once(spec: ScorerSpec, group: Group, model: nn.Module, stats: Mapping, **args: Any) -> torch.Tensor:
    """One evaluation of a spec without smoothing (a Smoothed part is its inner scorer's scores)."""
    from slimkit.primitives.importance import score_group

    if isinstance(spec, Named):
        return score_group(spec.name, group, model, stats, **args).float()
    if isinstance(spec, Smoothed):
        return score_once(spec.inner, group, model, stats, **args)
    return cast(torch.Tensor, sum(w * normalised(score_once(p, group, model, stats, **args)) for p, w in spec.parts))


def _key(group: Group) -> tuple[str, int | None]:
    return (group.kind, group.layer)


class ScoreAccumulator:
    """Scores of groups over one or more evaluations of a spec.

    ``update(groups, model, stats, **args)`` once per evaluation; ``scores(groups)`` the result.
    Groups are keyed by (kind, layer), so rebuilt groups of the same shapes continue their state.
    """

    def __init__(self, spec: ScorerSpec) -> None:
        self.spec = spec
        self.evaluations = 0
        if isinstance(spec, Named):
            self.totals: dict[tuple[str, int | None], torch.Tensor] = {}
        elif isinstance(spec, Smoothed):
            from slimkit.primitives.importance.platon import PlatonScorer

            self.smoother = PlatonScorer(lambda g, m, s, **a: score_once(spec.inner, g, m, s, **a), spec.x1, spec.x2)
        else:
            self.parts = [(ScoreAccumulator(part), weight) for part, weight in spec.parts]

    def update(self, groups: list[Group], model: nn.Module, stats: Mapping, **args: Any) -> None:
        self.evaluations += 1
        if isinstance(self.spec, Named):
            for group in groups:
                scores = score_once(self.spec, group, model, stats, **args)
                key = _key(group)
                self.totals[key] = scores if key not in self.totals else self.totals[key] + scores
        elif isinstance(self.spec, Smoothed):
            self.smoother.args = args
            self.smoother.update(groups, model, stats)
        else:
            for part, _weight in self.parts:
                part.update(groups, model, stats, **args)

    def scores(self, groups: list[Group]) -> list[torch.Tensor]:
        if self.evaluations == 0:
            raise SlimkitError("scores requested before any evaluation")
        if isinstance(self.spec, Named):
            return [self.totals[_key(g)] / self.evaluations for g in groups]
        if isinstance(self.spec, Smoothed):
            return self.smoother.scores(groups)
        per_part = [(part.scores(groups), weight) for part, weight in self.parts]
        return [sum(w * normalised(scores[i]) for scores, w in per_part) for i in range(len(groups))]


def score_groups(
    spec: ScorerSpec, groups: list[Group], model: nn.Module, evaluations: Iterable[Mapping], **args: Any
) -> list[torch.Tensor]:
    """Scores of every group over the given statistics dicts (one per evaluation; a list or a generator)."""
    accumulator = ScoreAccumulator(spec)
    for stats in evaluations:
        accumulator.update(groups, model, stats, **args)
        del stats  # with a generator of evaluations, one evaluation's statistics live at a time
    return accumulator.scores(groups)


__all__ = [
    "Blend",
    "Named",
    "ScoreAccumulator",
    "ScorerSpec",
    "Smoothed",
    "describe",
    "normalised",
    "parse_scorer",
    "score_groups",
    "score_once",
    "spec_gradients",
    "spec_kinds",
    "spec_names",
    "spec_needs",
    "spec_smooths",
]
