"""``mask_train_encoder`` (model scope): SP3's (or CoFi's) learned masks on a GLUE task model, binarised and fused.

After ``glue_finetune`` and ``pca_project_post``, ``hidden: per_norm`` trains one hidden gate per LayerNorm, FFN
filter gates and head and layer gates with the task loss plus the Lagrangian, binarises at the threshold meeting
``target.ratio`` and fuses; ``hidden: shared`` on the unprojected model is the CoFi-style masks-only baseline.
The target is a sparsity of the attention and FFN weight matrices (``target.of: layers``); ``intermediate: true``
adds SP3's MHA-intermediate masks. Batches come from the task's train split, ``batch_size`` examples per step.

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs, task_training_memory
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.datasets import gluedata
from slimkit.primitives.device.memory_model import StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.encoder import check_encoder_masks, train_encoder_masks
from slimkit.primitives.masks.mask_settings import EncoderMaskSettings
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import (
    ALL_ROLES,
    BudgetMode,
    ChangesProjections,
    ChecksRecipe,
    ReadsData,
    SharesTarget,
    StageArgs,
)


class MaskTrainEncoderArgs(
    EncoderMaskSettings, StageArgs, SharesTarget, ChangesProjections, ReadsData, ChecksRecipe, PlansMemory, ChecksModel
):
    """The mask settings (:class:`~slimkit.primitives.masks.mask_settings.EncoderMaskSettings`) and the task data."""

    encoder_only: ClassVar[bool] = True

    batch_size: int = Field(16, ge=1)
    """Training examples per optimizer step."""
    max_length: int = Field(128, ge=8)
    """Tokens per example; longer examples are truncated."""
    check_examples: int | None = Field(None, ge=0)
    """Dev examples for the masked-vs-fused comparison (None: the whole dev split; 0: none)."""

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """Eq. 30 counts the layers' block and residual matrices."""
        if recipe.target.of != "layers":
            raise ValueError(
                f"{where}: mask_train_encoder counts Eq. 30 (block matrices and residual matrices); set "
                f"target.of: layers (got {recipe.target.of})"
            )

    def needs_task(self) -> bool:
        return True

    def budget(self) -> BudgetMode:
        return "solve"

    def touches(self) -> frozenset[LinearRole]:
        return ALL_ROLES

    calibration_depends_on: ClassVar[tuple[str, ...]] = ("intermediate", "intermediate_basis")

    def needs_calibration(self) -> bool:
        # the MHA-intermediate projections read the calibration batches
        return self.intermediate and self.intermediate_basis == "pca"

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The backward through the task model at ``batch_size`` x ``max_length`` and, when the weights train
        (``learning_rate > 0``), their gradients, float32 masters and AdamW moments (the gates are negligible)."""
        memory = task_training_memory(stage, inputs, self.batch_size, self.max_length, self.learning_rate > 0)
        if self.learning_rate > 0:
            memory.advice = f"set learning_rate: 0 to train the masks alone (weights frozen), or {memory.advice}"
        return memory

    def check_model(self, model: Any) -> None:
        try:
            check_encoder_masks(model, self)
        except SlimkitError as error:
            raise SlimkitError(f"mask_train_encoder: {error}") from None


@register_stage(
    "mask_train_encoder",
    args=MaskTrainEncoderArgs,
    paper="SP3 §3.2 (masks on a post-norm encoder); CoFi (Xia et al. 2022) for the masks-only baseline",
    trains=True,
)
class MaskTrainEncoder:
    """Train SP3's per-norm (or CoFi's shared) hidden, filter, head and layer masks on the GLUE task; fuse."""

    def run_model(self, ctx: Context, args: MaskTrainEncoderArgs) -> StageResult:
        return mask_train_encoder(ctx, args)


def mask_train_encoder(ctx: Context, args: MaskTrainEncoderArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    target = ctx.recipe.target
    if target.of != "layers":
        raise SlimkitError(
            f"mask_train_encoder counts Eq. 30 (block matrices and residual matrices): set target.of: layers "
            f"(got {target.of})"
        )
    task = ctx.recipe.task
    if task is None:  # needs_task: the recipe's validation asks for one
        raise SlimkitError("mask_train_encoder: the recipe sets no task; set task to a GLUE task")
    examples = gluedata.read_split(task, "train")
    needed = args.total_steps * args.batch_size
    order: list[int] = []
    epoch = 0
    while len(order) < needed:
        order += gluedata.training_order(len(examples), ctx.recipe.seed, epoch)
        epoch += 1
    chosen = [examples[i] for i in order[:needed]]
    batches = list(gluedata.batches(ctx.tokenizer, chosen, args.batch_size, args.max_length))
    check = None
    if args.check_examples != 0:
        dev = gluedata.load_examples(task, "dev", args.check_examples)
        check = list(gluedata.batches(ctx.tokenizer, dev, 64, args.max_length))
    with ctx.tracker.task(f"mask_train_encoder {task}", args.total_steps) as advance:
        report = train_encoder_masks(
            ctx.model,
            batches,
            args,
            target.ratio,
            ctx.recipe.seed,
            lambda _step: advance(1),
            check_batches=check,
            tolerance=target.tolerance,
            calibration=ctx.calibration_batches() if args.intermediate else None,
        )
    report["epochs"] = needed / len(examples)
    report["examples_seen"] = needed
    agreement = report["fused"].get("masked_vs_fused", {})
    ctx.notes.append(
        f"mask_train_encoder: {report['steps']} steps in {report['seconds']:.0f} s; Eq. 30 sparsity "
        f"{report['binary_sparsity']:.2%} (fused model's counted weights: {report['achieved_sparsity']:.2%})"
        + (
            f"; masked vs fused on dev: {agreement['prediction_agreement']:.2%} same predictions"
            if "prediction_agreement" in agreement
            else ""
        )
    )
    if report["fused"]["placeholder_heads"] or report["fused"]["placeholder_filters"]:
        ctx.notes.append(
            f"mask_train_encoder: placeholder head in layers {report['fused']['placeholder_heads']}, placeholder "
            f"filter in layers {report['fused']['placeholder_filters']} (zero output; "
            f"{report['fused']['placeholder_params']:,} weights)"
        )
    return StageResult(report)
