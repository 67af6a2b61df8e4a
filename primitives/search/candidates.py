"""The block library's entries by name: which replacements of a layer's attention and MLP a search considers.

A :class:`CandidateSpec` is one replacement of one sub-block (``attention`` or ``mlp``) of a layer: the parent
itself (``dense``), the sub-block removed (``removed``), whole query heads or KV groups kept (``heads:6``,
``kv_groups:2``), MLP channels kept (``channels:768``), routed experts kept (``experts:6``) or a low-rank
factorisation keeping a fraction of the sub-block's projection parameters (``lowrank:0.5``). Units are named by the
count kept, so a name fixes the shape exactly and a written recipe reproduces it.

:class:`CandidateLadder` says which levels to try (fractions of each layer's units); :func:`layer_specs` turns it into
one layer's specs on that layer's shapes (counts rounded as the pruning stages round them: GQA multiples, the
target's alignment), dropping levels that round to the dense width or to nothing and levels that repeat.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.capabilities import refusal_message, spec_of
from slimkit.primitives.arch.moe import moe_blocks, moe_spec
from slimkit.primitives.errors import SlimkitError, unknown
from slimkit.primitives.groups import build_groups
from slimkit.primitives.select.plan import SelectionRules, multiple_for
from slimkit.primitives.select.rules import round_kept
from slimkit.primitives.settings import Strict

Part = Literal["attention", "mlp"]
PARTS: tuple[Part, ...] = ("attention", "mlp")
Kind = Literal["dense", "removed", "heads", "kv_groups", "channels", "experts", "lowrank"]
KINDS: tuple[Kind, ...] = ("dense", "removed", "heads", "kv_groups", "channels", "experts", "lowrank")
UNIT_KINDS: dict[str, str] = {"heads": "attention_head", "kv_groups": "kv_group", "channels": "mlp_channel"}
"""The coupling-group kind whose units a candidate kind keeps (experts are counted on the MoE block)."""
KIND_PART: dict[str, tuple[Part, ...]] = {
    "dense": PARTS,
    "removed": PARTS,
    "heads": ("attention",),
    "kv_groups": ("attention",),
    "channels": ("mlp",),
    "experts": ("mlp",),
    "lowrank": PARTS,
}
"""The sub-blocks each kind of replacement applies to."""
KIND_OPERATION: dict[str, str] = {
    "heads": "attention_head",
    "kv_groups": "kv_group",
    "channels": "mlp_channel",
    "experts": "expert",
    "removed": "blocks",
}
"""The operation (:data:`~slimkit.primitives.arch.capabilities.OPERATIONS`) each kind of replacement makes."""


@dataclass(frozen=True, order=True)
class CandidateSpec:
    """One replacement of one sub-block: its kind and what it keeps (units kept, or the fraction of parameters a
    low-rank factorisation keeps; None for ``dense`` and ``removed``)."""

    part: Part
    kind: Kind
    kept: float | None = None

    @property
    def name(self) -> str:
        if self.kept is None:
            return self.kind
        return f"{self.kind}:{self.kept:g}"

    @classmethod
    def parse(cls, part: str, name: str) -> CandidateSpec:
        """The spec a name means for ``part`` (``channels:768``, ``lowrank:0.5``, ``removed``); one line otherwise."""
        if part not in PARTS:
            raise SlimkitError(unknown("sub-block", part, PARTS))
        kind, _, value = name.partition(":")
        if kind not in KINDS:
            raise SlimkitError(f"{part} candidate {name!r}: " + unknown("kind", kind, KINDS))
        if part not in KIND_PART[kind]:
            raise SlimkitError(f"{part} candidate {name!r}: {kind} applies to {' and '.join(KIND_PART[kind])} only")
        if kind in ("dense", "removed"):
            if value:
                raise SlimkitError(f"{part} candidate {name!r}: {kind} takes no count")
            return cls(part, kind)
        try:
            number = float(value) if kind == "lowrank" else int(value)
        except ValueError:
            raise SlimkitError(
                f"{part} candidate {name!r}: {kind} needs "
                + ("a kept parameter fraction, e.g. lowrank:0.5" if kind == "lowrank" else "a kept count, e.g. :4")
            ) from None
        if (kind == "lowrank" and not 0.0 < number < 1.0) or (kind != "lowrank" and number < 1):
            raise SlimkitError(f"{part} candidate {name!r}: out of range")
        return cls(part, kind, number)


Levels = list[float]


def _fractions(value: Levels) -> Levels:
    if any(not 0.0 < level < 1.0 for level in value):
        raise ValueError("every level is a kept fraction strictly between 0 and 1")
    return sorted(set(value), reverse=True)


class CandidateLadder(Strict):
    """The levels a search tries in every layer (kept fractions of each layer's units or parameters)."""

    heads: Levels = Field(default_factory=lambda: [0.67, 0.34])
    """Query heads kept (every KV group keeps the same number); rounded to whole heads per KV group."""
    kv_groups: Levels = Field(default_factory=lambda: [0.67, 0.34])
    """KV groups kept, each with its query heads (shrinks the KV cache as well)."""
    attention_lowrank: Levels = Field(default_factory=lambda: [0.75, 0.5, 0.25])
    """Parameters of q, k, v, o kept by AWSVD factor pairs (LoRAP's 1:3 split between q+k and v+o); empty: none."""
    channels: Levels = Field(default_factory=lambda: [0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    """MLP channels kept (rounded to the target's mlp_channel alignment)."""
    mlp_lowrank: Levels = Field(default_factory=list)
    """Parameters of the MLP's projections kept by AWSVD factor pairs (each matrix the same fraction)."""
    experts: Levels = Field(default_factory=lambda: [0.75, 0.5])
    """Routed experts kept in MoE layers (at least the router's top-k; by routing frequency on the calibration)."""
    remove_attention: bool = True
    """Try removing the whole attention sub-block (at least one stays in the model)."""
    remove_mlp: bool = True
    """Try removing the whole MLP sub-block (at least one stays in the model)."""
    target_levels: bool = True
    """With the search's ``uniform``: add to each tied layer, beside every level of one sub-block, the other's level
    (MLP channels, a low-rank fraction) that lands the pair on the layer's share of the target."""

    @field_validator("heads", "kv_groups", "attention_lowrank", "channels", "mlp_lowrank", "experts")
    @classmethod
    def _kept_fractions(cls, value: Levels) -> Levels:
        return _fractions(value)

    def kinds(self) -> frozenset[str]:
        """The kinds of replacement with at least one level."""
        levels = {
            "heads": self.heads,
            "kv_groups": self.kv_groups,
            "channels": self.channels,
            "experts": self.experts,
            "lowrank": self.attention_lowrank + self.mlp_lowrank,
        }
        chosen = {kind for kind, values in levels.items() if values}
        if self.remove_attention or self.remove_mlp:
            chosen.add("removed")
        return frozenset(chosen)


def refused_kinds(model: nn.Module) -> dict[str, str]:
    """The kinds of replacement the model's architecture cannot take, each with the one-line reason."""
    spec = spec_of(model)
    found = {}
    for kind, operation in KIND_OPERATION.items():
        message = refusal_message(spec, operation, model.config) if spec is not None else None
        if message is not None:
            found[kind] = message
    return found


def _unit_specs(model: nn.Module, index: int, kind: Kind, levels: Levels, rules: SelectionRules) -> list[CandidateSpec]:
    unit_kind = UNIT_KINDS[kind]
    groups = build_groups(model, unit_kind, [index])
    if not groups:  # the sub-block was removed before the search
        return []
    (group,) = groups
    multiple = multiple_for(group, rules)
    counts = {round_kept(group.size * level, group.size, multiple, rules.min_keep) for level in levels}
    part: Part = "attention" if kind in ("heads", "kv_groups") else "mlp"
    return [CandidateSpec(part, kind, count) for count in sorted(counts, reverse=True) if 0 < count < group.size]


def _expert_specs(model: nn.Module, index: int, levels: Levels) -> list[CandidateSpec]:
    blocks = [block for block in moe_blocks(model) if block.index == index] if moe_spec(model) is not None else []
    if not blocks:
        return []
    (block,) = blocks
    counts = {max(block.top_k, round(block.num_experts * level)) for level in levels}
    return [CandidateSpec("mlp", "experts", c) for c in sorted(counts, reverse=True) if c < block.num_experts]


def layer_specs(
    model: nn.Module, index: int, ladder: CandidateLadder, align: dict[str, int], skip: Collection[str] = ()
) -> list[CandidateSpec]:
    """Layer ``index``'s candidates: for each present sub-block its parent (``dense``, first) and every distinct
    level of the ladder on this layer's shapes (``align``: kept-unit multiples by group kind, the target's), but for
    the kinds in ``skip`` (those :func:`refused_kinds` names)."""
    layer = ModelView(model).layer(index)
    rules = SelectionRules(round_to=dict(align))
    specs: list[CandidateSpec] = []
    moe = moe_spec(model) is not None and any(block.index == index for block in moe_blocks(model))
    roles = set(layer.roles)

    def units(kind: Kind, levels: Levels) -> list[CandidateSpec]:
        return [] if kind in skip else _unit_specs(model, index, kind, levels, rules)

    if layer.has_attention:  # softmax attention (a hybrid's linear-attention and Mamba layers keep theirs)
        specs.append(CandidateSpec("attention", "dense"))
        specs += units("heads", ladder.heads)
        if layer.num_heads != layer.num_kv_heads:  # without GQA a KV group is one query head
            specs += units("kv_groups", ladder.kv_groups)
        if {"q", "k", "v", "o"} <= roles:  # low-rank factors of the four projections (not a latent attention's)
            specs += [CandidateSpec("attention", "lowrank", level) for level in ladder.attention_lowrank]
        if ladder.remove_attention:
            specs.append(CandidateSpec("attention", "removed"))
    if layer.has_mlp:
        specs.append(CandidateSpec("mlp", "dense"))
        if moe:
            specs += [] if "experts" in skip else _expert_specs(model, index, ladder.experts)
        elif {"gate", "up", "down"} <= roles or {"up", "down"} <= roles:
            specs += units("channels", ladder.channels)
            specs += [CandidateSpec("mlp", "lowrank", level) for level in ladder.mlp_lowrank]
        if ladder.remove_mlp:
            specs.append(CandidateSpec("mlp", "removed"))
    return [spec for spec in specs if spec.kind not in skip]


__all__ = [
    "KINDS",
    "KIND_OPERATION",
    "PARTS",
    "CandidateLadder",
    "CandidateSpec",
    "Kind",
    "Part",
    "layer_specs",
    "refused_kinds",
]
