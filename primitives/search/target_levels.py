"""Levels solved from the target for ``uniform`` layers: the partner of each ladder level that lands a layer on its
share of the target.

Under ``uniform: [attention, mlp]`` every layer of one shape takes the same pair of replacements, so the whole model
removes ``layers x (attention removal + MLP removal)``: a fixed ladder offers few such totals, and none may fall in
the target's window. For each such layer this module adds, beside every ladder level of one sub-block, the level of
the other sub-block that makes the pair remove the layer's share of the target: MLP channels kept (both counts at
the alignment around the solution) and a low-rank fraction of either sub-block (one correction step on the exact
shapes), each only where the ladder already offers that kind there. The share is the target spread over the layers
in proportion to the parameters their sub-blocks hold (of the target's part), so layers of one shape get the same
names and stay tied. The selection still chooses among all candidates by score; the solved levels only make pairs on
the target exist.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping

from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.groups import layer_group
from slimkit.primitives.search.build import BuildSettings, parent_kept, part_paths, reshape, timing_structure
from slimkit.primitives.search.candidates import PARTS, UNIT_KINDS, CandidateSpec, Part
from slimkit.primitives.select.plan import SelectionRules, multiple_for
from slimkit.primitives.select.rules import min_kept

LOWRANK_DIGITS = 4
"""Decimals a solved low-rank fraction keeps (its name fixes it; finer steps change no rank)."""


def kept_units_for(removal: float, units: int, unit_params: int, multiple: int = 1, minimum: int = 1) -> list[int]:
    """The kept unit counts, at ``multiple``, on either side of removing ``removal`` parameters from ``units`` units
    of ``unit_params`` each (one count where the solution is on a multiple); none kept dense or below the minimum."""
    if removal <= 0 or unit_params <= 0:
        return []
    exact = units - removal / unit_params
    counts = {math.floor(exact / multiple) * multiple, math.ceil(exact / multiple) * multiple}
    floor = min_kept(multiple, minimum)
    return sorted((c for c in counts if floor <= c < units), reverse=True)


def kept_fraction_for(removal: float, params: int) -> float | None:
    """The fraction of ``params`` a low-rank factorisation keeps to remove ``removal`` of them (rounded to
    :data:`LOWRANK_DIGITS`); None outside (0, 1)."""
    if params <= 0:
        return None
    kept = round(1.0 - removal / params, LOWRANK_DIGITS)
    return kept if 0.0 < kept < 1.0 else None


def shape_removal(model: nn.Module, index: int, spec: CandidateSpec, part: str, settings: BuildSettings) -> int:
    """Parameters of ``part`` (of :func:`params_by_part`) that ``spec`` removes from layer ``index``, from its shapes
    alone (the model is left as it was)."""
    if spec.kind == "dense":
        return 0
    before = params_by_part(model)[part]
    with parent_kept(model, index, spec.part):
        reshape(model, index, spec, timing_structure(model, index, spec, settings))
        after = params_by_part(model)[part]
    return before - after


def block_params(model: nn.Module, index: int, sub_block: Part, part: str) -> int:
    """Parameters of layer ``index``'s ``sub_block`` that count in the target's ``part``."""
    if part not in ("total", "layers", *PARTS):
        return 0
    if part in PARTS and part != sub_block:
        return 0
    layer = ModelView(model).layer(index)
    return sum(
        p.numel() for path in part_paths(layer, sub_block) for p in layer.module.get_submodule(path).parameters()
    )


def _channel_solver(
    model: nn.Module, index: int, align: Mapping[str, int], part: str, settings: BuildSettings
) -> Callable[[float], list[CandidateSpec]]:
    """Layer ``index``'s MLP channel counts for a removal (its per-channel parameters probed once)."""
    group = layer_group(model, UNIT_KINDS["channels"], index)
    unit_params = shape_removal(model, index, CandidateSpec("mlp", "channels", group.size - 1), part, settings)
    multiple = multiple_for(group, SelectionRules(round_to=dict(align)))

    def solve(removal: float) -> list[CandidateSpec]:
        return [CandidateSpec("mlp", "channels", c) for c in kept_units_for(removal, group.size, unit_params, multiple)]

    return solve


def _lowrank_partner(
    model: nn.Module, index: int, sub_block: Part, removal: float, part: str, settings: BuildSettings
) -> list[CandidateSpec]:
    params = block_params(model, index, sub_block, part)
    kept = kept_fraction_for(removal, params)
    if kept is None:
        return []
    # the ranks round and split the budget: one step corrects the fraction on the exact shapes
    missed = removal - shape_removal(model, index, CandidateSpec(sub_block, "lowrank", kept), part, settings)
    corrected = kept_fraction_for(removal + missed, params)
    return [CandidateSpec(sub_block, "lowrank", corrected if corrected is not None else kept)]


def layer_shares(
    model: nn.Module, specs: Mapping[int, list[CandidateSpec]], wanted: float, part: str
) -> dict[int, float]:
    """The target's ``wanted`` removal spread over the layers with candidates, in proportion to the parameters of
    ``part`` their sub-blocks hold."""
    held = {
        index: sum(block_params(model, index, sub, part) for sub in {spec.part for spec in found})
        for index, found in specs.items()
        if found
    }
    total = sum(held.values())
    return {index: wanted * params / total for index, params in held.items()} if total else {}


def partner_specs(
    model: nn.Module,
    index: int,
    specs: list[CandidateSpec],
    share: float,
    align: Mapping[str, int],
    part: str,
    settings: BuildSettings,
) -> list[CandidateSpec]:
    """Layer ``index``'s specs with, for every level of one sub-block (not ``removed``), the other sub-block's level
    that makes the pair remove ``share`` of ``part`` (each kind only where ``specs`` offers it)."""
    kinds = {(spec.part, spec.kind) for spec in specs}
    present = [p for p in PARTS if (p, "dense") in kinds]
    channels = _channel_solver(model, index, align, part, settings) if ("mlp", "channels") in kinds else None
    added: list[CandidateSpec] = []
    for sub_block in present:
        others = [p for p in present if p != sub_block] or [sub_block]
        for level in [s for s in specs if s.part == sub_block and s.kind != "removed"]:
            if len(present) == 1 and level.kind != "dense":
                continue  # a layer with one sub-block: the level is solved from dense alone
            rest = share - shape_removal(model, index, level, part, settings)
            for other in others:
                if other == "mlp" and channels is not None:
                    added += channels(rest)
                if (other, "lowrank") in kinds:
                    added += _lowrank_partner(model, index, other, rest, part, settings)
    known = set(specs)
    fresh = sorted({spec for spec in added if spec not in known}, key=lambda s: (s.kind, -(s.kept or 0.0)))
    return [*specs, *[s for s in fresh if s.part == "attention"], *[s for s in fresh if s.part == "mlp"]]


def with_target_levels(
    model: nn.Module,
    specs: Mapping[int, list[CandidateSpec]],
    tied: Collection[Part],
    wanted: float,
    align: Mapping[str, int],
    part: str,
    settings: BuildSettings,
) -> dict[int, list[CandidateSpec]]:
    """Every layer's specs, with the partner levels (:func:`partner_specs`) added to the layers whose every present
    sub-block is in ``tied``; the others as they are."""
    shares = layer_shares(model, specs, wanted, part)
    by_shape: dict[tuple[object, ...], list[CandidateSpec]] = {}
    solved: dict[int, list[CandidateSpec]] = {}
    for index, found in specs.items():
        parts = {spec.part for spec in found}
        if not (found and parts <= set(tied) and index in shares):
            solved[index] = list(found)
            continue
        # layers of one shape with the same specs and share get the same partners: probe the first of them only
        key = (layer_shape(model, index), tuple(found), shares[index])
        if key not in by_shape:
            by_shape[key] = partner_specs(model, index, found, shares[index], align, part, settings)
        solved[index] = list(by_shape[key])
    return solved


def layer_shape(model: nn.Module, index: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Layer ``index``'s modules and parameter shapes: equal for two layers whose candidates remove equal counts."""
    layer = ModelView(model).layer(index).module
    return tuple(
        (f"{name}.{param_name}", type(module).__name__, tuple(param.shape))
        for name, module in layer.named_modules()
        for param_name, param in module.named_parameters(recurse=False)
    )


__all__ = [
    "LOWRANK_DIGITS",
    "block_params",
    "kept_fraction_for",
    "kept_units_for",
    "layer_shape",
    "layer_shares",
    "partner_specs",
    "shape_removal",
    "with_target_levels",
]
