"""The allocation a block's pre-pass decided (:mod:`slimkit.engine.allocation_prepass`), as the layer-wise
stages read it: kept units per layer and kind in the block's cache, each layer's fraction, and the report entry;
for ``lowrank``, the rank of every chosen matrix (:class:`RankAllocation`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slimkit.engine.context import Context
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.select.plan import Fraction

if TYPE_CHECKING:
    from slimkit.stages.selection import SelectionArgs


@dataclass
class LayerAllocation:
    """A stage's allocation for one block: kept units per layer and kind, and its report entry."""

    kept: dict[int, dict[str, int]]
    sizes: dict[int, dict[str, int]]
    report: dict = field(default_factory=dict)

    def fraction(self, layer: int) -> Fraction:
        """The layer's removal fraction per kind, which the uniform plan turns back into exactly the kept counts."""
        return {kind: 1.0 - kept / self.sizes[layer][kind] for kind, kept in self.kept[layer].items()}


@dataclass
class RankAllocation:
    """A ``lowrank`` stage's global allocation for one block: the rank of each chosen matrix by layer and role (None:
    it stays dense), the parameters of the target's part they save, and the report entry."""

    ranks: dict[int, dict[str, int | None]]
    saved: int
    report: dict = field(default_factory=dict)


def rank_allocation_key(roles: list[str]) -> str:
    return f"allocation:lowrank:{'+'.join(roles)}"


def allocated_ranks(ctx: Context, roles: list[str]) -> RankAllocation | None:
    """The block's global rank allocation for a lowrank stage of these roles; None before the pre-pass ran."""
    return ctx.block_cache.get(rank_allocation_key(roles))


def allocation_key(stage: str, args: SelectionArgs) -> str:
    return f"allocation:{stage}:{'+'.join(args.groups)}"


def allocated_fraction(ctx: Context, stage: str, args: SelectionArgs, layer: int) -> Fraction | None:
    """The layer's fraction from the block's allocation; None for a uniform allocation."""
    if args.allocation_settings() == "uniform":
        return None
    found = ctx.block_cache.get(allocation_key(stage, args))
    if found is None:
        raise SlimkitError(
            f"{stage}: allocation is decided in the pre-pass of a layer-wise block; run the stage through a recipe"
        )
    return found.fraction(layer)


def allocation_entry(ctx: Context, stage: str, args: SelectionArgs) -> dict | None:
    """The report entry of the block's allocation (None for uniform)."""
    if args.allocation_settings() == "uniform":
        return None
    found = ctx.block_cache.get(allocation_key(stage, args))
    return found.report if found is not None else None


__all__ = [
    "LayerAllocation",
    "RankAllocation",
    "allocated_fraction",
    "allocated_ranks",
    "allocation_entry",
    "allocation_key",
    "rank_allocation_key",
]
