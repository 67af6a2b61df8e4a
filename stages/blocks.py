"""``remove_blocks`` (model scope): remove whole attention or MLP blocks of decoder layers, chosen by BlockPruner's
iterative search on the calibration loss (:mod:`slimkit.primitives.blocks`).

How many blocks go: ``count`` (exactly that many), ``ratio`` (while what they hold stays within ``ratio`` of the
target's part), or neither: the stage removes blocks while they fit in what is left of the target plus its tolerance.
What the loaded model decides (an architecture without removable blocks, more blocks than the eligible layers hold,
a plan that would remove every block of a kind) is refused in one line before calibration.

Method note: docs/methods/block-removal.md.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import LAYERWISE_ADVICE, MemoryInputs
from slimkit.primitives.arch import BLOCK_KINDS, BlockKind
from slimkit.primitives.blocks import check_removable, kept_per_kind, present_blocks, search_blocks
from slimkit.primitives.blocks.search import SearchStep
from slimkit.primitives.device.memory_model import StageMemory, forward_activation_bytes, layer_input_bytes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.select import eligible_layers
from slimkit.recipes.stage_args import BudgetMode, ReadsData, SharesTarget, StageArgs


class RemoveBlocksArgs(StageArgs, SharesTarget, ReadsData, PlansMemory, ChecksModel):
    kinds: list[BlockKind] = Field(default_factory=lambda: list(BLOCK_KINDS), min_length=1)
    """Which sub-blocks may go, each once: attention (a layer's attention with its norm), mlp (its MLP with its
    norm)."""
    count: int | None = Field(None, ge=1)
    """Remove exactly this many blocks; None: set by ratio, or solved from the recipe target."""
    ratio: float | None = Field(None, gt=0.0, lt=1.0, allow_inf_nan=False)
    """Remove blocks holding at most this fraction of the dense model's target part (target.of); None: count, or
    solved from the recipe target."""
    skip_first: int = Field(0, ge=0)
    """Leave the first this many decoder layers whole."""
    skip_last: int = Field(0, ge=0)
    """Leave the last this many decoder layers whole."""
    batches: int | None = Field(None, ge=1)
    """Calibration batches (of calibration.batch_size sequences) the search measures the loss on; None: all."""

    @model_validator(mode="after")
    def _one_amount(self) -> RemoveBlocksArgs:
        if self.count is not None and self.ratio is not None:
            raise ValueError("count and ratio: give one of them (or neither, to solve the recipe target)")
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds: each kind once (got {', '.join(self.kinds)})")
        return self

    def budget(self) -> BudgetMode:
        return "solve" if self.count is None and self.ratio is None else "explicit"

    def needs_calibration(self) -> bool:
        return True

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The inputs of every layer, kept for the search (:mod:`slimkit.primitives.blocks.search`), and one
        forward's activations."""
        samples = inputs.samples
        if self.batches is not None and inputs.calibration is not None:
            samples = min(samples, self.batches * inputs.calibration.batch_size)
        shape, dtype_bytes = inputs.shape, inputs.dtype_bytes
        memory = StageMemory(stage, advice=f"{LAYERWISE_ADVICE}, or set remove_blocks' batches")
        kept = layer_input_bytes(shape, samples, inputs.seq_len, dtype_bytes)
        memory.parts["layer inputs"] = (shape.layers + 1) * kept // 2
        memory.parts["activations"] = forward_activation_bytes(shape, inputs.tokens, dtype_bytes)
        return memory

    def operations(self) -> frozenset[str]:
        return frozenset({"blocks"})

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)
        view = check_removable(model)
        layers = eligible_layers(view.num_layers, self.skip_first, self.skip_last)
        present = present_blocks(model, self.kinds, layers)
        kept = kept_per_kind(model)
        # At least one block of each kind stays in the model (primitives.blocks.check_blocks).
        removable = sum(min(sum(b.kind == kind for b in present), kept[kind] - 1) for kind in self.kinds)
        if self.count is not None and self.count > removable:
            raise SlimkitError(
                f"remove_blocks: count {self.count} is more than the {removable} {' and '.join(self.kinds)} blocks "
                f"layers {layers[0]}-{layers[-1]} can lose (one block of each kind stays in the model); use at most "
                f"{removable}, or change kinds / skip_first / skip_last"
            )
        if removable == 0:
            raise SlimkitError(
                f"remove_blocks: layers {layers[0]}-{layers[-1]} have no {' or '.join(self.kinds)} block that can go "
                "(one block of each kind stays in the model)"
            )


def _step_entry(step: SearchStep) -> dict[str, Any]:
    return {
        "block": str(step.block),
        "loss": round(step.loss, 6),
        "perplexity": round(step.perplexity, 4),
        "params": step.params,
        "tried": step.tried,
    }


@register_stage(
    "remove_blocks",
    args=RemoveBlocksArgs,
    paper="BlockPruner (Zhong et al. 2024) Algorithm 1: iterative removal of the attention / MLP block whose "
    "removal raises calibration perplexity least; ShortGPT (Men et al. 2024) for whole-block removal",
)
class RemoveBlocks:
    """Remove whole attention / MLP blocks, one at a time, each the one whose removal raises calibration loss least."""

    def run_model(self, ctx: Context, args: RemoveBlocksArgs) -> StageResult:
        return StageResult(remove_blocks(ctx, args))


def remove_blocks(ctx: Context, args: RemoveBlocksArgs) -> dict[str, Any]:
    """The search and the removal; returns the report entry."""
    args.check_model(ctx.model)  # a stage called outside the runner is refused before the search too
    layers = eligible_layers(ctx.view.num_layers, args.skip_first, args.skip_last)
    batches = ctx.calibration_batches()
    if args.batches is not None:
        batches = batches[: args.batches]
    target = ctx.recipe.target
    dense = ctx.params_before[target.part]
    limit = enough = None
    if args.ratio is not None:
        limit = round(args.ratio * dense)
    elif args.count is None:
        wanted, slack = ctx.params_to_remove(), round(target.tolerance * dense)
        limit, enough = wanted + slack, max(0, wanted - slack)

    def progress(step: SearchStep) -> None:
        advance(1)
        ctx.tracker.log(
            f"remove_blocks: {step.block} ({step.params:,} parameters) -> calibration perplexity "
            f"{step.perplexity:.2f} ({step.tried} tried)"
        )

    with ctx.tracker.task("remove_blocks", args.count) as advance:
        result = search_blocks(
            ctx.model,
            batches,
            args.kinds,
            layers,
            count=args.count,
            limit=limit,
            enough=enough,
            part=target.part,
            progress=progress,
        )
    if not result.steps:
        ctx.notes.append(f"remove_blocks: no {' or '.join(args.kinds)} block fits in {limit} parameters; none removed")
    return {
        "seconds": round(result.seconds, 2),
        "loss_tokens": result.tokens,
        "kinds": list(args.kinds),
        "layers": [layers[0], layers[-1]],
        "loss_before": round(result.loss_before, 6),
        "perplexity_before": round(math.exp(result.loss_before), 4),
        "removed": [_step_entry(step) for step in result.steps],
        "removed_params": result.removed_params,
    }


__all__ = ["RemoveBlocks", "RemoveBlocksArgs", "remove_blocks"]
