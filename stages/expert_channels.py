"""``prune_expert_channels`` (model scope): remove intermediate channels inside every routed expert of a MoE model.

One calibration pass collects, per expert, the sums of squares of its intermediate activations over only the tokens
routed to it (:mod:`slimkit.primitives.calibration.routing`); channels are scored Wanda-style and every expert of a
layer keeps the same number of channels (the fused experts hold one width), each its own best ones or, with
``shared``, the same indices in every expert (:mod:`slimkit.primitives.experts.channels`). How many go: ``ratio`` of
every expert's channels (an explicit share), or solved from the recipe's one target: every layer loses the same
number of channels, whose parameters (gate and up rows, down column, in every expert) make up what is left of it.
Kept widths are multiples of 8 (transformers' grouped expert matmul needs 16-byte rows), so the removed count is
rounded to keep them so. No refit of the kept channels. Method note: ``docs/methods/moe-experts.md``.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field
from torch import nn

from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage_args import BudgetMode, StageArgs
from slimkit.primitives.arch.moe import MoEBlock, check_all_sparse, moe_blocks
from slimkit.primitives.calibration.routing import collect_routing
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts.channels import (
    WIDTH_MULTIPLE,
    channel_scores,
    keep_expert_channels,
    kept_channels,
)


def channel_params(block: MoEBlock) -> int:
    """Parameters one channel holds across a layer's experts (a gate row, an up row and a down column each)."""
    return block.num_experts * 3 * int(block.router.weight.shape[1])


class ExpertChannelArgs(StageArgs):
    ratio: float | None = Field(None, gt=0.0, lt=1.0, allow_inf_nan=False)
    """Share of every expert's channels removed (an explicit share); None: solved from the recipe target."""
    shared: bool = False
    """Keep the same channel indices in every expert of a layer (scores summed over the experts); false: each expert
    keeps its own best channels (the same count)."""
    batches: int | None = Field(None, ge=1)
    """Calibration batches to read; None: all."""

    def budget(self) -> BudgetMode:
        return "solve" if self.ratio is None else "explicit"

    def plan(self, ctx: Context) -> int:
        if self.ratio is None:
            return 0
        return sum(_aligned_removal(b.width, self.ratio * b.width) * channel_params(b) for b in moe_blocks(ctx.model))

    def needs_calibration(self) -> bool:
        return True

    def operations(self) -> frozenset[str]:
        return frozenset({"expert_channel"})

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)  # a dense architecture: refused with its reason
        check_all_sparse(model.config)
        if not moe_blocks(model):
            raise SlimkitError("prune_expert_channels: the model has no MoE layer left")


def _aligned_removal(width: int, count: float) -> int:
    """Channels to remove from ``width`` so the kept width is the multiple of :data:`WIDTH_MULTIPLE` nearest to
    ``width - count`` (at least one multiple is kept)."""
    kept = max(WIDTH_MULTIPLE, WIDTH_MULTIPLE * round((width - count) / WIDTH_MULTIPLE))
    return max(0, width - kept)


def _removed(ctx: Context, args: ExpertChannelArgs, blocks: list[MoEBlock]) -> dict[int, int]:
    if args.ratio is not None:
        return {b.index: _aligned_removal(b.width, args.ratio * b.width) for b in blocks}
    per_channel = sum(channel_params(b) for b in blocks)
    count = ctx.params_to_remove() / per_channel
    narrowest = min(b.width for b in blocks)
    if count > narrowest - WIDTH_MULTIPLE:
        raise SlimkitError(
            f"prune_expert_channels: the target needs {round(count)} channels removed from every expert, but the "
            f"narrowest layer's experts have {narrowest} (at least {WIDTH_MULTIPLE} stay); lower target.ratio"
        )
    return {b.index: _aligned_removal(b.width, count) for b in blocks}


@register_stage(
    "prune_expert_channels",
    args=ExpertChannelArgs,
    scope="model",
    paper="Wanda (Sun et al. 2024) channel scores on the tokens routed to each expert; Minitron (NVIDIA "
    "Model-Optimizer) prunes a MoE layer's expert width homogeneously",
)
def prune_expert_channels(ctx: Context, args: ExpertChannelArgs) -> None:
    """Remove the lowest-scoring intermediate channels of every routed expert (the same count in a layer)."""
    args.check_model(ctx.model)
    start = time.perf_counter()
    batches = ctx.calibration_batches()[: args.batches] if args.batches else ctx.calibration_batches()
    stats = collect_routing(ctx.model, batches, channels=True)
    blocks = [b for b in moe_blocks(ctx.model) if b.index in stats]
    removed = _removed(ctx, args, blocks)
    layers: list[dict[str, Any]] = []
    for block in blocks:
        before = block.width
        keep = before - removed[block.index]
        channel_sq = stats[block.index].channel_sq
        if channel_sq is None:
            raise SlimkitError(f"prune_expert_channels: layer {block.index}: no channel statistics were gathered")
        scores = channel_scores(block.experts.down_proj.detach(), channel_sq)
        keep_expert_channels(block, kept_channels(scores, keep, args.shared))
        layers.append({"layer": block.index, "width_before": before, "width": keep})
    ctx.report_stage(
        "prune_expert_channels",
        {
            "seconds": round(time.perf_counter() - start, 2),
            "calibration_tokens": sum(int(b.numel()) for b in batches),
            "shared": args.shared,
            "widths": [e["width"] for e in layers],
            "removed_params": sum(removed[b.index] * channel_params(b) for b in blocks),
            "layers": layers,
        },
    )


__all__ = ["ExpertChannelArgs", "channel_params", "prune_expert_channels"]
