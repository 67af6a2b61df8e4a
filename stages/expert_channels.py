"""``prune_expert_channels`` (model scope): remove intermediate channels inside every routed expert of a MoE model.

One calibration pass collects, per expert, the sums of squares of its intermediate activations over only the tokens
routed to it (:mod:`slimkit.primitives.calibration.routing`); channels are scored Wanda-style and every expert of a
layer keeps the same number of channels (the fused experts hold one width), each its own best ones or, with
``shared``, the same indices in every expert (:mod:`slimkit.primitives.experts.channels`). How many go: ``ratio`` of
every expert's channels (an explicit share), or solved from the recipe's one target: every layer loses the same
number of channels, whose parameters (gate and up rows, down column, in every expert) make up what is left of it.
Kept widths are multiples of 8 (transformers' grouped expert matmul needs 16-byte rows), so the removed count is
rounded to keep them so. ``refit``: each expert's down projection is then refitted on its kept channels by least
squares from the routing-weighted Gram of its activations (:mod:`slimkit.primitives.experts.refit`), collected in
passes over groups of layers whose Grams fit ``refit_memory``, deepest group first, so every Gram is taken on layers
not yet pruned and the result does not depend on the grouping. Method note: ``docs/methods/moe-experts.md``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel, PlansMemory, PlansRemoval
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, MemoryInputs
from slimkit.primitives.arch.moe import MoEBlock, check_all_sparse, moe_blocks
from slimkit.primitives.calibration.routing import ExpertRouting, collect_routing
from slimkit.primitives.device.memory_model import FLOAT32, StageMemory, forward_activation_bytes
from slimkit.primitives.device.placement import parse_size
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts.channels import (
    WIDTH_MULTIPLE,
    channel_scores,
    keep_expert_channels,
    kept_channels,
)
from slimkit.primitives.experts.refit import refit_expert_down
from slimkit.primitives.reconstruct.solve import DEFAULT_OBS_DAMPING
from slimkit.recipes.schema import SizeText
from slimkit.recipes.stage_args import BudgetMode, ReadsData, SharesTarget, StageArgs

FLOAT64 = 8
REFIT_ONLY = ("refit_memory", "damping")
"""Settings that only the refit reads."""


def channel_params(block: MoEBlock) -> int:
    """Parameters one channel holds across a layer's experts (a gate row, an up row and a down column each)."""
    biases = 2 if getattr(block.experts, "gate_up_proj_bias", None) is not None else 0  # GPT-OSS's gate and up
    return block.num_experts * (3 * int(block.router.weight.shape[1]) + biases)


def gram_bytes(experts: int, width: int) -> int:
    """Bytes of one layer's float32 routing-weighted Grams (``experts x width x width``)."""
    return experts * width * width * FLOAT32


def solve_bytes(hidden: int, width: int) -> int:
    """Bytes of one expert's float64 refit: its Gram symmetrised (three ``width^2`` copies at the peak; the kept
    block's damped copy and Cholesky factor come after) and its down projection, ``D G`` and the solution."""
    return 3 * width * width * FLOAT64 + 3 * hidden * width * FLOAT64


def refit_passes(layers: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """Groups of layer indices, deepest group first, each holding as many layers (in order from the deepest) as
    their Grams fit ``budget`` bytes, at least one; ``layers`` are ``(index, gram bytes)``."""
    groups: list[list[int]] = []
    used = 0
    for index, size in sorted(layers, reverse=True):
        if not groups or used + size > budget:
            groups.append([])
            used = 0
        groups[-1].insert(0, index)
        used += size
    return groups


class ExpertChannelArgs(StageArgs, SharesTarget, PlansRemoval, ReadsData, PlansMemory, ChecksModel):
    ratio: float | None = Field(None, gt=0.0, lt=1.0, allow_inf_nan=False)
    """Share of every expert's channels removed (an explicit share); None: solved from the recipe target."""
    shared: bool = False
    """Keep the same channel indices in every expert of a layer (scores summed over the experts); false: each expert
    keeps its own best channels (the same count)."""
    batches: int | None = Field(None, ge=1)
    """Calibration batches to read; None: all."""
    refit: bool = False
    """Refit every expert's down projection on its kept channels by least squares on its routed tokens (false: the
    kept channels are sliced as they are)."""
    refit_memory: SizeText = "4GiB"
    """refit: the Grams one calibration pass may hold (``experts x width^2`` float32 numbers a layer, on the device
    of each router); layers are refitted in as many passes as this needs, at least one layer a pass."""
    damping: float = Field(DEFAULT_OBS_DAMPING, ge=0.0, allow_inf_nan=False)
    """refit: ridge relative to the mean diagonal of each expert's Gram, pulling towards the sliced columns (so, as
    for OBS, SparseGPT's 1% shrinks nothing towards zero; an expert sees few tokens, and a near-zero ridge overfits
    them)."""

    @model_validator(mode="after")
    def _refit_settings(self) -> ExpertChannelArgs:
        if not self.refit:
            fields = type(self).model_fields
            given = [name for name in REFIT_ONLY if getattr(self, name) != fields[name].default]
            if given:
                raise ValueError(f"{', '.join(given)}: settings of the refit; set refit: true or leave them out")
        return self

    def budget(self) -> BudgetMode:
        return "solve" if self.ratio is None else "explicit"

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """One forward's activations; with ``refit``, one pass's Grams and one expert's float64 solve."""
        memory = StageMemory(stage, advice=f"{ACTIVATION_ADVICE}, or lower {stage}'s refit_memory")
        memory.parts["activations"] = forward_activation_bytes(inputs.shape, inputs.tokens, inputs.dtype_bytes)
        if self.refit:
            shape = inputs.shape
            layer = gram_bytes(max(shape.experts, 1), shape.intermediate)
            per_pass = max(1, parse_size(self.refit_memory, "refit_memory") // max(layer, 1))
            memory.parts["expert grams"] = min(shape.layers, per_pass) * layer
            memory.parts["refit solve"] = solve_bytes(shape.hidden, shape.intermediate)
        return memory

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
    paper="Wanda (Sun et al. 2024) channel scores on the tokens routed to each expert; Minitron (NVIDIA "
    "Model-Optimizer) prunes a MoE layer's expert width homogeneously",
)
class PruneExpertChannels:
    """Remove the lowest-scoring intermediate channels of every routed expert (the same count in a layer), and with
    ``refit`` refit each expert's down projection on the channels it keeps."""

    def run_model(self, ctx: Context, args: ExpertChannelArgs) -> StageResult:
        return prune_expert_channels(ctx, args)


def prune_expert_channels(ctx: Context, args: ExpertChannelArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    args.check_model(ctx.model)
    start = time.perf_counter()
    batches = ctx.calibration_batches()[: args.batches] if args.batches else ctx.calibration_batches()
    sizes = [(b.index, gram_bytes(b.num_experts, b.width)) for b in moe_blocks(ctx.model)]
    passes = refit_passes(sizes, parse_size(args.refit_memory, "refit_memory")) if args.refit else []
    stats = collect_routing(ctx.model, batches, channels=True, grams=passes[0] if passes else False)
    blocks = [b for b in moe_blocks(ctx.model) if b.index in stats]
    removed = _removed(ctx, args, blocks)
    layers: dict[int, dict[str, Any]] = {}
    kept: dict[int, torch.Tensor] = {}
    for block in blocks:
        keep = block.width - removed[block.index]
        channel_sq = stats[block.index].channel_sq
        if channel_sq is None:
            raise SlimkitError(f"prune_expert_channels: layer {block.index}: no channel statistics were gathered")
        scores = channel_scores(block.rows().down, channel_sq)
        kept[block.index] = kept_channels(scores, keep, args.shared)
        layers[block.index] = {"layer": block.index, "width_before": block.width, "width": keep}
    if not args.refit:
        for block in blocks:
            keep_expert_channels(block, kept[block.index])
    by_index = {b.index: b for b in blocks}
    for number, group in enumerate(passes):
        if number > 0:  # the deeper groups are pruned already; these layers' inputs are not
            stats = collect_routing(ctx.model, batches, grams=True, layers=group)
        for index in group:
            if index in by_index:
                layers[index]["refit"] = _refit_layer(by_index[index], stats[index], kept[index], args, number)
    return StageResult(
        {
            "seconds": round(time.perf_counter() - start, 2),
            "calibration_tokens": sum(int(b.numel()) for b in batches),
            "shared": args.shared,
            "widths": [layers[b.index]["width"] for b in blocks],
            "removed_params": sum(removed[b.index] * channel_params(b) for b in blocks),
            **({"refit_passes": len(passes), "refit_damping": args.damping} if args.refit else {}),
            "layers": [layers[b.index] for b in blocks],
        }
    )


def _refit_layer(
    block: MoEBlock, routing: ExpertRouting, index: torch.Tensor, args: ExpertChannelArgs, number: int
) -> dict[str, Any]:
    """Slice ``block``'s experts to channels ``index`` with their down projections refitted; what the refit did."""
    if routing.gram is None:
        raise SlimkitError(f"prune_expert_channels: layer {block.index}: no Grams were gathered for the refit")
    fitted = refit_expert_down(block.rows().down, routing.gram, index, damping=args.damping)
    routing.gram = None
    keep_expert_channels(block, index)
    rows = block.rows()
    block.set_rows(replace(rows, down=fitted.down.to(rows.down.dtype)))
    used = [d for d in fitted.damping if d is not None]
    counts = [int(c) for c in routing.counts.tolist() if c > 0]
    return {
        "pass": number + 1,
        "damping": max(used) if used else None,
        "experts_sliced_only": fitted.sliced_only,
        "fewest_tokens": min(counts) if counts else 0,
        "error_sliced": float(f"{fitted.relative_error(False):.4g}"),
        "error_refit": float(f"{fitted.relative_error(True):.4g}"),
    }


__all__ = [
    "ExpertChannelArgs",
    "channel_params",
    "gram_bytes",
    "prune_expert_channels",
    "refit_passes",
    "solve_bytes",
]
