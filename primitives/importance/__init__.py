"""Importance scorers: ``score(group, model, stats, **args) -> 1-D tensor`` over the group's units.

Method note: docs/methods/scorers.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, Member

Aggregation = Literal["l1", "l2", "linf", "mean"]
"""How a unit's per-element scores are reduced to one: sum of absolute values, L2 norm, largest absolute value, mean
absolute value."""
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
TaylorOrder = Literal["first", "second", "mix"]
"""The Taylor term: first g*w, second 0.5*h*w^2, mix their difference."""
TaylorLevel = Literal["element", "vector"]
"""Taylor importance per element (aggregated |salience|) or per vector (|sum of salience|)."""


def reduce_units(values: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """``[units, k]`` -> ``[units]``."""
    if how == "l1":
        return values.abs().sum(dim=1)
    if how == "l2":
        return values.pow(2).sum(dim=1).sqrt()
    if how == "linf":
        return values.abs().amax(dim=1)
    if how == "mean":
        return values.abs().mean(dim=1)
    raise ValueError(f"unknown aggregation '{how}'; allowed: {', '.join(AGGREGATIONS)}")


def gather_units(values: torch.Tensor, member: Member) -> torch.Tensor:
    """The elements of each unit of ``member``: ``[units, per_unit * rest]``."""
    moved = values.movedim(member.dim, 0)
    picked = moved[member.indices.reshape(-1).to(moved.device)]  # group indices live on the CPU
    return picked.reshape(member.indices.shape[0], -1)


def member_sum(group: Group, model: nn.Module, per_member: Callable[[Member, torch.Tensor], torch.Tensor | None]):
    """Sum over distinct member parameters of ``per_member(member, tensor) -> [units]`` (None skips).

    ``per_member`` sees the parameter in float32 on its own device (a bfloat16/float16 weight is upcast
    first); the per-unit sums are float32 on the CPU (one number per unit), whatever the model's device."""
    total = torch.zeros(group.size, dtype=torch.float32)
    for member, tensor in group.distinct_members(model):
        scores = per_member(member, tensor.detach().float())
        if scores is not None:
            total += scores.detach().to(device=total.device, dtype=total.dtype)
    return total


@dataclass(frozen=True)
class ScorerDef:
    """A registered scorer: ``fn(group, model, stats, **args) -> [units]`` and what it reads."""

    name: str
    fn: Callable[..., torch.Tensor]
    needs: tuple[str, ...] = ()
    """Statistics keys it reads: ``input_norms`` (per-Linear input norms by module path) and/or
    ``gradients`` (calibration-loss gradients, anything with ``.of(tensor) -> (g, g^2)``)."""
    kinds: tuple[str, ...] | None = None
    """Group kinds it can score (None: any)."""
    summary: str = ""
    gradients: Callable[[nn.Module, list[Group], Mapping[str, Any]], GradientRequest] | None = None
    """For a scorer that reads ``gradients``: which tensors' gradients and which moments it reads for
    these groups and scorer args (None: every parameter, sum and squares)."""


@dataclass(frozen=True)
class GradientRequest:
    """The calibration-gradient statistics a scorer reads: the tensors (by identity) and whether the sum of
    squared gradients is read besides the sum (second-order / Fisher terms)."""

    tensors: tuple[torch.Tensor, ...]
    squares: bool = False

    def merged(self, other: GradientRequest) -> GradientRequest:
        seen = {id(t): t for t in (*self.tensors, *other.tensors)}
        return GradientRequest(tuple(seen.values()), self.squares or other.squares)


SCORERS: dict[str, ScorerDef] = {}


def register_scorer(
    name: str,
    needs: tuple[str, ...] = (),
    kinds: tuple[str, ...] | None = None,
    gradients: Callable[[nn.Module, list[Group], Mapping[str, Any]], GradientRequest] | None = None,
):
    """Register ``fn`` as the scorer ``name`` (a recipe's ``scorer:`` value)."""

    def decorate(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if name in SCORERS:
            raise ValueError(f"scorer '{name}' registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        SCORERS[name] = ScorerDef(name, fn, tuple(needs), kinds, summary, gradients)
        return fn

    return decorate


def scorer_def(name: str) -> ScorerDef:
    if name not in SCORERS:
        from slimkit.primitives.errors import unknown

        raise SlimkitError(unknown("scorer", name, sorted(SCORERS)))
    return SCORERS[name]


@register_scorer("magnitude")
def magnitude(group: Group, model: nn.Module, stats: Mapping, aggregation: Aggregation = "l1", **_) -> torch.Tensor:
    """|W| aggregated per unit (l1 / l2: the unit's L1 / L2 magnitude)."""
    return member_sum(group, model, lambda m, w: reduce_units(gather_units(w.abs(), m), aggregation))


@register_scorer("activation", needs=("input_norms",))
def activation(group: Group, model: nn.Module, stats: Mapping, aggregation: Aggregation = "l2", **_) -> torch.Tensor:
    """Wanda-style |W_ij| * ||X_j||_2 over the unit's Linear weights."""
    norms: Mapping[str, torch.Tensor] = stats["input_norms"]

    def score(member: Member, weight: torch.Tensor) -> torch.Tensor | None:
        module = model.get_submodule(member.module)
        if member.param != "weight" or not isinstance(module, nn.Linear):
            return None
        weighted = weight.abs() * norms[member.module].to(weight)[None, :]
        return reduce_units(gather_units(weighted, member), aggregation)

    return member_sum(group, model, score)


def member_tensors(model: nn.Module, groups: list[Group]) -> tuple[torch.Tensor, ...]:
    """Every distinct member parameter of ``groups`` (by identity)."""
    found: dict[int, torch.Tensor] = {}
    for group in groups:
        for _member, tensor in group.distinct_members(model):
            found.setdefault(id(tensor), tensor)
    return tuple(found.values())


def taylor_gradients(model: nn.Module, groups: list[Group], args: Mapping[str, Any]) -> GradientRequest:
    """Taylor reads the gradient of every member of the scored groups; the squares for order second / mix."""
    return GradientRequest(member_tensors(model, groups), squares=args.get("order", "first") != "first")


@register_scorer("taylor", needs=("gradients",), gradients=taylor_gradients)
def taylor(
    group: Group,
    model: nn.Module,
    stats: Mapping,
    order: TaylorOrder = "first",
    level: TaylorLevel = "vector",
    aggregation: Aggregation = "l1",
    **_,
) -> torch.Tensor:
    """LLM-Pruner's Taylor importance of the unit's weights (first / second order / mix)."""
    gradients = stats["gradients"]

    def score(member: Member, weight: torch.Tensor) -> torch.Tensor:
        grad, grad_sq = gradients.of(member.tensor(model))
        if order != "first" and grad_sq is None:
            raise SlimkitError(f"taylor order {order} needs the summed squared gradients, which were not gathered")
        if order == "first":
            salience = grad.float() * weight
        else:
            second = 0.5 * grad_sq.float() * weight * weight
            salience = second if order == "second" else grad.float() * weight - second
        units = gather_units(salience, member)
        return units.sum(dim=1).abs() if level == "vector" else reduce_units(units, aggregation)

    return member_sum(group, model, score)


@register_scorer("random")
def random(group: Group, model: nn.Module, stats: Mapping, generator: torch.Generator | None = None, **_):
    """Uniform noise from the run's seeded generator (a baseline)."""
    return torch.rand(group.size, generator=generator)


def score_group(name: str, group: Group, model: nn.Module, stats: Mapping, **args: Any) -> torch.Tensor:
    """Scores of ``group``'s units by the registered scorer ``name`` (checked: kind, statistics, finite);
    float32 on the CPU."""
    definition = scorer_def(name)
    where = f"layer {group.layer}" if group.layer is not None else "model"
    if definition.kinds is not None and group.kind not in definition.kinds:
        raise SlimkitError(f"scorer {name} cannot score {group.kind} groups; it scores {', '.join(definition.kinds)}")
    missing = [key for key in definition.needs if key not in stats]
    if missing:
        raise SlimkitError(
            f"scorer {name} needs the statistics {', '.join(missing)} (have: {', '.join(sorted(stats)) or 'none'})"
        )
    # Scores are float32 on the CPU (one number per unit), whatever the model's device and dtype.
    scores = definition.fn(group, model, stats, **args).detach().to(device="cpu", dtype=torch.float32)
    if not torch.isfinite(scores).all():
        raise RuntimeError(f"{where}: non-finite {name} scores for {group.kind}")
    return scores


# Coupled-component importance (CCE); imported last because it builds on the definitions above.
from slimkit.primitives.importance.coupled import COUPLED_KINDS, coupled_gradient_weights, coupled_scores  # noqa: E402


def coupled_gradients(model: nn.Module, groups: list[Group], args: Mapping[str, Any]) -> GradientRequest:
    """The coupled scorer reads the gradient sums (no squares) of the projection weights of the scored groups."""
    return GradientRequest(tuple(coupled_gradient_weights(model, groups)), squares=False)


register_scorer("coupled", needs=("gradients",), kinds=COUPLED_KINDS, gradients=coupled_gradients)(coupled_scores)

from slimkit.primitives.importance.obs_saliency import OBS_KINDS, obs_scores  # noqa: E402

register_scorer("obs", needs=("dense_consumers",), kinds=OBS_KINDS)(obs_scores)

from slimkit.primitives.importance.compose import (  # noqa: E402
    Blend,
    Named,
    ScoreAccumulator,
    ScorerSpec,
    Smoothed,
    parse_scorer,
    spec_needs,
    spec_smooths,
)


def needs_of(name: str) -> tuple[str, ...]:
    """Statistics the registered scorer ``name`` reads."""
    return scorer_def(name).needs


__all__ = [
    "AGGREGATIONS",
    "SCORERS",
    "Aggregation",
    "Blend",
    "GradientRequest",
    "Named",
    "ScoreAccumulator",
    "ScorerDef",
    "ScorerSpec",
    "Smoothed",
    "TaylorLevel",
    "TaylorOrder",
    "gather_units",
    "member_sum",
    "member_tensors",
    "needs_of",
    "parse_scorer",
    "reduce_units",
    "register_scorer",
    "score_group",
    "scorer_def",
    "spec_needs",
    "spec_smooths",
]
