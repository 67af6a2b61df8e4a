"""``lowrank`` (layer scope): replace projections by low-rank pairs (LoRAP, Li et al. 2024, §3.2).

Each chosen projection W becomes ``LowRankLinear`` factors from activation-weighted SVD (AWSVD,
Eqs. 5-7, with the layer's calibration input norms) or plain truncated SVD (the Table 5 ablation).
The parameter budget of the chosen projections is ``(1 - fraction)`` of their dense count, with
``fraction`` LoRAP's layer ratio (Appendix C.1) unless ``ratio`` is given. ``allocation: lorap``
splits an attention budget 1:3 between (W_q + W_k) and (W_v + W_o) by parameter counts, keeping a
group dense when its share exceeds it (Appendix C "Special Case"); ``uniform`` gives every matrix
the same fraction (the Table 6 ablation). No rank exceeds the speed cap ``mac_fraction`` of the
dense MACs: two thin matmuls near the MAC break-even were measured slower than one dense matmul
on this CPU (see ``slimkit.primitives.lowrank``), and the issue asks that a low-rank layer never be
slower than dense.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slimkit.primitives.arch import LayerView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import (
    LowRankLinear,
    allocate_attention,
    dense_params,
    max_useful_rank,
    rank_for_budget,
)
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict
from slimkit.recipes.stages.prune import lorap_layer_ratio

Role = Literal["q", "k", "v", "o", "gate", "up", "down"]


class LowRankArgs(Strict):
    roles: list[Role] = Field(default_factory=lambda: ["q", "k", "v", "o"], min_length=1)
    method: Literal["awsvd", "svd"] = "awsvd"
    allocation: Literal["lorap", "uniform"] = "lorap"
    qk_share: float = Field(0.25, gt=0.0, lt=1.0)
    """Share of the attention budget for (W_q + W_k) under ``allocation: lorap`` (1:3 -> 0.25)."""
    mac_fraction: float = Field(0.75, gt=0.0, le=1.0)
    """Speed cap: a factorisation may cost at most this fraction of the dense MACs."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of the chosen projections' parameters to remove; None: LoRAP's layer ratio."""

    @model_validator(mode="after")
    def _lorap_needs_attention(self) -> LowRankArgs:
        if self.allocation == "lorap" and sorted(self.roles) != ["k", "o", "q", "v"]:
            raise ValueError("allocation: lorap splits the attention budget; use roles [q, k, v, o] or uniform")
        return self


def _uniform_ranks(shapes: dict[str, tuple[int, int]], keep: float, mac_fraction: float) -> dict[str, int | None]:
    ranks: dict[str, int | None] = {}
    for role, (d_out, d_in) in shapes.items():
        cap = max_useful_rank(d_in, d_out, mac_fraction)
        budget = int(keep * dense_params(d_in, d_out))
        ranks[role] = min(rank_for_budget(d_in, d_out, budget), cap) if cap >= 1 else None
    return ranks


@register_stage("lowrank", args=LowRankArgs, scope="layer", needs_calibration=lambda a: a.method == "awsvd")
def lowrank(ctx: Context, args: LowRankArgs, layer: LayerView, stats: dict) -> None:
    """Replace projections of one layer by (activation-weighted) SVD factor pairs within a budget."""
    fraction = args.ratio if args.ratio is not None else lorap_layer_ratio(ctx)
    shapes: dict[str, tuple[int, int]] = {}
    for role in args.roles:
        module = layer.linear(role)
        if isinstance(module, LowRankLinear):
            raise SlimkitError(f"layer {layer.index}: {role} is already low-rank")
        shapes[role] = tuple(module.weight.shape)
    if args.allocation == "lorap":
        budget = int((1.0 - fraction) * sum(dense_params(d_in, d_out) for d_out, d_in in shapes.values()))
        ranks = allocate_attention(shapes, budget, args.qk_share, args.mac_fraction)
    else:
        ranks = _uniform_ranks(shapes, 1.0 - fraction, args.mac_fraction)
    view = ctx.view
    for role, rank in ranks.items():
        if rank is None:
            continue
        linear = layer.linear(role)
        norms = stats["input_norms"][view.path_of(linear)] if args.method == "awsvd" else None
        layer.set_linear(role, LowRankLinear.from_linear(linear, rank, norms))
    entry = ctx.stage_report.setdefault("lowrank", {"fraction": fraction, "ranks": {}})
    entry["ranks"][str(layer.index)] = ranks
