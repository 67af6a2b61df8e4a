"""``glue_finetune`` (model scope): full fine-tuning on the recipe's GLUE task.

Used first, to turn the encoder into a task model (SP3 Appendix D.2 fine-tunes BERT on each task
before compressing it), and after compression as recovery. The recipe must set ``task``; the runner
has already made the model a sequence classifier for it. Settings and what is reported: see
:mod:`slimkit.primitives.finetune.glue_task_model`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs, task_training_memory
from slimkit.primitives.datasets import gluedata
from slimkit.primitives.device.memory_model import StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.glue_task_model import GlueFinetuneConfig, finetune_glue
from slimkit.recipes.stage_args import ReadsData, StageArgs


class GlueFinetuneArgs(StageArgs, ReadsData, PlansMemory, ChecksModel):
    encoder_only: ClassVar[bool] = True

    learning_rate: float = Field(2e-5, gt=0, le=1.0)
    """Peak AdamW learning rate (linear decay to 0; the paper: 1e-5 for BERT on GLUE)."""
    epochs: float = Field(3.0, gt=0)
    """Passes over the (subset of the) train split; fractions allowed; ``max_steps`` may stop it sooner."""
    max_steps: int | None = Field(250, ge=0)
    """Optimizer steps at most (None: ``epochs`` alone; 0: no training). Default sized for a CPU."""
    batch_size: int = Field(32, ge=1)
    """Training examples per optimizer step."""
    max_length: int = Field(128, ge=8)
    """Tokens per example; longer examples are truncated."""
    train_examples: int | None = Field(None, ge=1)
    """A seeded subset of the train split (None: all of it)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay, on matrices only (not biases or LayerNorm weights); 0: none."""
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the steps with linear learning-rate warm-up from 0, in [0, 1) (0: none)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient-norm clipping threshold (None: no clipping)."""

    def needs_task(self) -> bool:
        return True

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """Every weight trained (AdamW) on ``batch_size`` examples of ``max_length`` tokens (``max_steps: 0``:
        nothing)."""
        trains = self.max_steps != 0
        if not trains:
            return StageMemory(stage)
        return task_training_memory(stage, inputs, self.batch_size, self.max_length, trains_weights=True)


@register_stage("glue_finetune", args=GlueFinetuneArgs, trains=True, paper="GLUE task fine-tuning")
class GlueFinetune:
    """Fine-tune every weight on the recipe's GLUE task (AdamW, linear decay) on its train split."""

    def run_model(self, ctx: Context, args: GlueFinetuneArgs) -> StageResult:
        return glue_finetune(ctx, args)


def glue_finetune(ctx: Context, args: GlueFinetuneArgs) -> StageResult:
    """The fine-tuning of ``ctx.model``; returns its report."""
    task = ctx.recipe.task
    if task is None:  # needs_task: the recipe's validation asks for one
        raise SlimkitError("glue_finetune: the recipe sets no task; set task to a GLUE task")
    config = GlueFinetuneConfig(task=task, seed=ctx.recipe.seed, **args.model_dump())
    available = len(gluedata.read_split(config.task, "train"))
    total = config.total_steps(min(config.train_examples or available, available))
    with ctx.tracker.task(f"glue_finetune {config.task}", total) as advance:
        report = finetune_glue(ctx.model, ctx.tokenizer, config, progress=lambda _step: advance(1))
    return StageResult(report)
