"""``lowrank`` (layer scope): replace projections by low-rank pairs (LoRAP, Li et al. 2024, §3.2).

Each chosen projection becomes ``LowRankLinear`` factors from activation-weighted SVD (AWSVD), plain truncated SVD,
or SVD-LLM's whitened SVD (``whiten``). The parameter budget of the chosen projections is ``(1 - fraction)`` of their
dense count, with ``fraction`` LoRAP's layer ratio unless ``ratio`` is given; ``allocation`` splits it
(``lorap``: 1:3 in the attention; ``uniform``; ``{global: {max_fraction}}``: by the matrices' weighted-SVD
spectra, decided in the block's pre-pass). No rank exceeds the speed cap ``mac_fraction`` of the dense MACs,
so a low-rank layer is never slower than dense.

Method note: docs/methods/lorap-awsvd.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel, ChecksReach, PlansMemory, PlansRemoval, ReadsLayerStatistics
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import PrePass, StageResult
from slimkit.primitives.allocate.allocation_settings import GlobalSettings, parse_allocation
from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import FLOAT32, ModelShape
from slimkit.primitives.errors import SlimkitError, unknown
from slimkit.primitives.evaluate.counting import param_parts
from slimkit.primitives.lowrank import (
    LowRankLinear,
    allocate_attention,
    dense_params,
    max_useful_rank,
    rank_for_budget,
)
from slimkit.primitives.lowrank.rank_budget import ATTENTION_ROLES
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import (
    BudgetMode,
    ChangesProjections,
    ChecksRecipe,
    ReadsData,
    SharesTarget,
    StageArgs,
)
from slimkit.stages.allocation_results import RankAllocation
from slimkit.stages.layer_rule import check_layer_rule, layer_rule_ratio

LOWRANK_ALLOCATIONS = ("lorap", "uniform", "global")
"""How a lowrank stage shares its budget: within each layer (lorap, uniform) or across all of them (global)."""


class LowRankArgs(
    StageArgs,
    SharesTarget,
    PlansRemoval,
    ChangesProjections,
    ReadsData,
    ChecksRecipe,
    PlansMemory,
    ReadsLayerStatistics,
    ChecksModel,
    ChecksReach,
):
    roles: list[LinearRole] = Field(default_factory=lambda: list(ATTENTION_ROLES), min_length=1)
    """Projections replaced by low-rank pairs (q, k, v, o, gate, up, down)."""
    method: Literal["awsvd", "whiten", "svd"] = "awsvd"
    """awsvd: SVD of W diag(||X_j||) (LoRAP Eqs. 5-7, needs calibration); whiten: SVD of W S with S S^T the
    input Gram (SVD-LLM; minimises the output error on the calibration inputs, needs calibration); svd: plain
    truncated SVD."""
    allocation: str | dict[str, Any] = "lorap"
    """lorap: the attention budget split qk_share : (1 - qk_share) between (W_q + W_k) and (W_v + W_o) in every
    layer; uniform: every matrix keeps the same fraction; {global: {max_fraction}}: the same total shared among every
    chosen matrix of every layer, least relative weighted-SVD error per parameter saved first (max_fraction: the
    most of one matrix's parameters it may lose)."""
    qk_share: float = Field(0.25, gt=0.0, lt=1.0)
    """Share of the attention budget for (W_q + W_k) under ``allocation: lorap`` (1:3 -> 0.25)."""
    mac_fraction: float = Field(0.75, gt=0.0, le=1.0)
    """Speed cap: a factorisation may cost at most this fraction of the dense MACs."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    """Fraction of the chosen projections' parameters to remove; None: LoRAP's layer ratio (Appendix C.1)
    from what is left of the recipe target when the block starts."""

    @field_validator("allocation")
    @classmethod
    def _known_allocation(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        name = value if isinstance(value, str) else next(iter(value), None) if isinstance(value, dict) else None
        if name == "search":
            raise ValueError(
                "a search over ranks is not available for lowrank; use {global: {max_fraction}} (every matrix ranked "
                "by its weighted-SVD spectrum), lorap or uniform"
            )
        if name not in LOWRANK_ALLOCATIONS or (isinstance(value, dict) and name != "global"):
            raise ValueError(unknown("allocation", str(name), LOWRANK_ALLOCATIONS))
        if name == "global":
            parse_allocation(value)
        return value

    def global_settings(self) -> GlobalSettings | None:
        """The cross-layer allocation's settings; None for lorap or uniform (the same rule in every layer)."""
        if self.allocation in ("lorap", "uniform"):
            return None
        parsed = parse_allocation(self.allocation)
        return parsed if isinstance(parsed, GlobalSettings) else None

    @model_validator(mode="after")
    def _lorap_needs_attention(self) -> LowRankArgs:
        if self.allocation == "lorap" and sorted(self.roles) != ["k", "o", "q", "v"]:
            raise ValueError("allocation: lorap splits the attention budget; use roles [q, k, v, o] or uniform")
        return self

    calibration_depends_on: ClassVar[tuple[str, ...]] = ("method",)

    def needs_calibration(self) -> bool:
        return self.method != "svd"

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        return 3 * shape.hidden * shape.intermediate * FLOAT32  # one SVD in float32

    def reach_check(self, ctx: Context, stage: str) -> None:
        """With ``allocation: global``: the share refused on shapes alone when the matrices cannot save it."""
        if self.global_settings() is None:
            return
        from slimkit.stages.lowrank_prepass import check_rank_reachable

        check_rank_reachable(ctx, self)

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """Without ``ratio``, LoRAP's layer rule: defined for a target of the model or the layers."""
        if self.ratio is None:
            check_layer_rule(recipe, where)

    def layer_grams(self) -> frozenset[LinearRole]:
        return frozenset(self.roles) if self.method == "whiten" else frozenset()

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else "layer"

    def plan(self, ctx: Context) -> int:
        return planned_removal(ctx, self)

    def touches(self) -> frozenset[LinearRole]:
        return frozenset(self.roles)

    def makes_lowrank(self) -> frozenset[LinearRole]:
        return frozenset(self.roles)

    def check_model(self, model: Any) -> None:
        super().check_model(model)
        spec = ModelView(model).spec
        missing = [role for role in self.roles if getattr(spec, role) is None]
        if missing:
            raise SlimkitError(
                f"lowrank: roles {', '.join(missing)}: {spec.model_type} layers have no such projection (a plain "
                f"MLP has up and down only); drop {'it' if len(missing) == 1 else 'them'} from roles"
            )


def _uniform_ranks(shapes: dict[str, tuple[int, int]], keep: float, mac_fraction: float) -> dict[str, int | None]:
    ranks: dict[str, int | None] = {}
    for role, (d_out, d_in) in shapes.items():
        cap = max_useful_rank(d_in, d_out, mac_fraction)
        budget = int(keep * dense_params(d_in, d_out))
        ranks[role] = min(rank_for_budget(d_in, d_out, budget), cap) if cap >= 1 else None
    return ranks


def lowrank_fraction(ctx: Context, args: LowRankArgs) -> float:
    """The share of the chosen matrices the stage removes: ``ratio``, or LoRAP's layer ratio when the block starts."""
    return args.ratio if args.ratio is not None else layer_rule_ratio(ctx)


def layer_shapes(layer: LayerView, roles: list[LinearRole]) -> dict[str, tuple[int, int]]:
    """``role -> (d_out, d_in)`` of the chosen projections of ``layer``, refusing one that is already low-rank."""
    shapes: dict[str, tuple[int, int]] = {}
    for role in roles:
        if role not in layer.roles:  # a hybrid's layer without this block (or a removed block)
            continue
        module = layer.linear(role)
        if isinstance(module, LowRankLinear):
            raise SlimkitError(f"layer {layer.index}: {role} is already low-rank")
        shapes[role] = tuple(module.weight.shape)
    return shapes


def _layer_ranks(
    layer: LayerView, args: LowRankArgs, fraction: float, allocation: RankAllocation | None = None
) -> dict[str, int | None]:
    """The rank of every chosen projection of ``layer`` (None: the projection stays dense); under a global allocation
    the pre-pass's ``allocation``."""
    if args.global_settings() is not None:
        if allocation is None:
            raise SlimkitError(
                "lowrank: allocation global is decided in the pre-pass of a layer-wise block; run it through a recipe"
            )
        return allocation.ranks.get(layer.index, {})  # a hybrid's layer holding none of the roles has no ranks
    shapes = layer_shapes(layer, list(args.roles))
    if not shapes:  # a hybrid's layer holding none of the roles (LoRAP's attention in a DeltaNet or Mamba layer)
        return {}
    if args.allocation == "lorap":
        budget = int((1.0 - fraction) * sum(dense_params(d_in, d_out) for d_out, d_in in shapes.values()))
        return allocate_attention(shapes, budget, args.qk_share, args.mac_fraction)
    return _uniform_ranks(shapes, 1.0 - fraction, args.mac_fraction)


def whiten_failure(layer: LayerView, role: str, error: ValueError) -> SlimkitError:
    """The one line for a projection whose input Gram no damping makes definite (NaN/inf entries)."""
    return SlimkitError(f"lowrank: layer {layer.index} {role}: method whiten cannot factor it ({error})")


def counted(ctx: Context, weight: torch.Tensor, parts: dict | None = None) -> bool:
    """Whether ``weight``'s parameters count toward the recipe target's part."""
    part = ctx.recipe.target.part
    name, in_layers = (parts or param_parts(ctx.model))[id(weight)]
    return part == "total" or name == part or (part == "layers" and in_layers)


def planned_removal(ctx: Context, args: LowRankArgs) -> int:
    """Parameters of the target's part the stage will remove (ranks depend on shapes only; under a global allocation
    the wanted share, until the block's pre-pass decides the ranks and the plan then becomes what they save)."""
    fraction = lowrank_fraction(ctx, args)
    if args.global_settings() is not None:
        return global_wanted(ctx, args, fraction)
    parts = param_parts(ctx.model)
    removed = 0
    for layer in ctx.view.layers:
        ranks = _layer_ranks(layer, args, fraction)
        for role in (r for r in args.roles if r in ranks):  # a hybrid's layer holds some of the roles
            rank = ranks[role]
            weight = layer.linear(role).weight
            if rank is not None and counted(ctx, weight, parts):
                d_out, d_in = weight.shape
                removed += dense_params(d_in, d_out) - rank * (d_in + d_out)
    return removed


def global_wanted(ctx: Context, args: LowRankArgs, fraction: float) -> int:
    """What a global allocation removes: ``fraction`` of every chosen matrix's parameters together (the total the
    per-layer rules aim at), all of them counted by the target."""
    parts = param_parts(ctx.model)
    total = 0
    for layer in ctx.view.layers:
        layer_shapes(layer, list(args.roles))  # refuses a projection that is already low-rank
        for role in (r for r in args.roles if r in layer.roles):
            weight = layer.linear(role).weight
            if not counted(ctx, weight, parts):
                raise SlimkitError(
                    f"lowrank: allocation global shares parameters of target.of {ctx.recipe.target.of}, and "
                    f"{role} is not part of it; drop it from roles or use allocation uniform"
                )
            total += weight.numel()
    return int(fraction * total)


@dataclass
class LowRankState:
    """A ``lowrank`` stage across its block: its share, the pre-pass's ranks (``allocation: global``), and the ranks
    chosen per layer."""

    ctx: Context
    args: LowRankArgs
    fraction: float
    allocation: RankAllocation | None = None
    ranks: dict[str, dict[str, int | None]] = field(default_factory=dict)


@register_stage(
    "lowrank",
    args=LowRankArgs,
    paper="LoRAP §3.2 (Eqs. 5-7, AWSVD; 1:3 parameter allocation; Appendix C.1 layer ratio)",
)
class LowRank:
    """Replace projections of one layer by (activation-weighted) SVD factor pairs within a budget."""

    def start(self, ctx: Context, args: LowRankArgs) -> LowRankState:
        return LowRankState(ctx, args, lowrank_fraction(ctx, args))

    def allocation_prepass(self, state: LowRankState) -> PrePass | None:
        """With ``allocation: global``: every chosen matrix's spectrum on the block's dense pass, then the ranks
        (:class:`~slimkit.stages.lowrank_prepass.RankSpectra`)."""
        if state.args.global_settings() is None:
            return None
        from slimkit.stages.lowrank_prepass import RankSpectra

        return RankSpectra(state)

    def run_layer(self, state: LowRankState, layer: LayerView, stats: LayerStats) -> None:
        args, view = state.args, state.ctx.view
        ranks = _layer_ranks(layer, args, state.fraction, state.allocation)
        for role in (r for r in args.roles if r in ranks):  # a hybrid's layer holds some of the roles
            rank = ranks[role]
            if rank is None:
                continue
            linear = cast(nn.Linear, layer.linear(role))  # plain: layer_shapes refused a low-rank pair
            norms = stats["input_norms"][view.path_of(linear)] if args.method == "awsvd" else None
            gram = stats["dense_consumers"][role].gram if args.method == "whiten" else None
            try:
                layer.set_linear(role, LowRankLinear.from_linear(linear, rank, norms, gram=gram))
            except ValueError as error:  # a Gram with NaN/inf entries
                raise whiten_failure(layer, role, error) from None
        state.ranks[str(layer.index)] = ranks

    def finish(self, state: LowRankState) -> StageResult:
        entry: dict[str, Any] = {"fraction": state.fraction, "ranks": state.ranks}
        if state.allocation is not None:
            entry["allocation"] = state.allocation.report
        return StageResult(entry)
