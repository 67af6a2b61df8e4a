"""``mask_train`` (model scope): SP3's learned masks, trained with the weights, binarised and fused.

The LLM setting of SP3 (Hu et al.; Appendix F, Fig. 5): after ``pca_project`` at full width
(Group PCA, so the residual stream of each layer group is in its principal-component coordinates
and a residual matrix sits where the basis changes), one hard-concrete gate per group masks the
stream's coordinates and one per FFN filter masks the filters; weights and masks are trained on a
local corpus with the causal-LM loss plus the Lagrangian sparsity loss (Eq. 14), the masks are
binarised at the threshold that meets the recipe's target and fused into the weights. See
:mod:`slimkit.primitives.masks.stream` for the loss, the whole-model count (the target is a
fraction of the dense model's parameters, ``target.of: model``) and the schedule.

The BERT/GLUE counterpart (per-norm hidden masks with FFN, head and layer masks on a post-norm
encoder) is ``mask_train_encoder`` (:mod:`.encoder_masks`).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs, training_memory
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.device.memory_model import StageMemory, adamw_training_bytes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import check_corpus
from slimkit.primitives.masks.mask_settings import StreamMaskSettings
from slimkit.primitives.masks.stream import train_stream_masks
from slimkit.primitives.masks.training import MaskTarget
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import ALL_ROLES, BudgetMode, ChangesProjections, ChecksRecipe, SharesTarget, StageArgs


class MaskTrainArgs(
    StreamMaskSettings, StageArgs, SharesTarget, ChangesProjections, ChecksRecipe, PlansMemory, ChecksModel
):
    """The mask settings (:class:`~slimkit.primitives.masks.mask_settings.StreamMaskSettings`) and the training data."""

    batch_size: int = Field(4, ge=1)
    """Token windows per optimizer step."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training window."""
    dataset: str = "alpaca"
    """Local corpus the training windows are drawn from: wikitext2, ptb, c4 or alpaca."""

    _dataset = field_validator("dataset")(check_corpus)

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """The masks' Lagrangian counts the whole model (its expected sparsity is of every parameter)."""
        if recipe.target.of != "model":
            raise ValueError(
                f"{where}: mask_train counts the whole model; set target.of: model (got {recipe.target.of})"
            )

    def budget(self) -> BudgetMode:
        return "solve"

    def operations(self) -> frozenset[str]:
        return frozenset({"hidden_masks"})

    def touches(self) -> frozenset[LinearRole]:
        return ALL_ROLES

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The backward's activations at the stage's own training batch and, when the weights train
        (``learning_rate > 0``), their gradients, float32 masters and AdamW moments (the gates are negligible)."""
        memory = training_memory(stage, inputs, self.batch_size, self.seq_len)
        if self.learning_rate > 0:
            memory.parts |= adamw_training_bytes(inputs.shape.total_params(), inputs.dtype_bytes)
            memory.advice = f"set learning_rate: 0 to train the masks alone (weights frozen), or {memory.advice}"
        return memory


@register_stage(
    "mask_train",
    args=MaskTrainArgs,
    paper="SP3 §3.2, Appendix F (hard-concrete masks, expected-sparsity Lagrangian)",
    trains=True,
)
class MaskTrain:
    """Train SP3's hidden (per layer group) and FFN-filter masks with the weights, then binarise and fuse."""

    def run_model(self, ctx: Context, args: MaskTrainArgs) -> StageResult:
        return mask_train(ctx, args)


def mask_train(ctx: Context, args: MaskTrainArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    target = ctx.recipe.target
    if target.of != "model":
        raise SlimkitError(f"mask_train counts the whole model: set target.of: model (got {target.of})")
    goal = MaskTarget(target.ratio, ctx.params_before["total"])
    spec = CalibrationSpec(args.dataset, args.total_steps * args.batch_size, args.seq_len, ctx.recipe.seed + 1)
    ids = calibration_batches(ctx.tokenizer, spec)
    batches = list(ids.split(args.batch_size))
    with ctx.tracker.task("mask_train", args.total_steps) as advance:
        report = train_stream_masks(ctx.model, batches, args, goal, ctx.recipe.seed, progress=lambda _step: advance(1))
    report["tokens"] = int(ids.numel())
    ctx.notes.append(
        f"mask_train: {report['steps']} steps in {report['seconds']:.0f} s; "
        f"{report['achieved_sparsity']:.2%} of the dense model's parameters removed"
    )
    return StageResult(report)
