"""What the recovery stages (``lora``, ``distill``) share about *how long* and *on what* they train: the token budget
and its loop's settings, declared once (:class:`RecoveryArgs`), and the run of a token budget from a stage
(:func:`run_token_budget`: checkpoints under the run's output, progress in tokens with tokens/s and time left, the
loss curves plotted into the output folder).

With ``tokens`` unset, a stage trains ``steps`` batches of randomly drawn windows as before (no validation, no
checkpoints); ``tokens`` switches to the token-budgeted loop (:mod:`slimkit.primitives.finetune.recovery`). Method
note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel
from slimkit.engine.context import Context
from slimkit.engine.stage import ArtifactWriter
from slimkit.primitives.finetune import LoraConfig
from slimkit.primitives.finetune.checkpoint import model_content_key
from slimkit.primitives.finetune.full_recovery import recover_all_weights
from slimkit.primitives.finetune.process_group import world
from slimkit.primitives.finetune.recovery import RecoveryConfig, RecoveryResult, TokenObjective
from slimkit.primitives.finetune.token_recovery import recover_in_tokens
from slimkit.primitives.finetune.token_stream import TextSource, check_data_files, check_windows, folder_files
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import StageArgs

TOKEN_ONLY = (
    "data_folder",
    "micro_batch_size",
    "autocast",
    "schedule",
    "warmup_steps",
    "max_grad_norm",
    "validation_windows",
    "validate_every",
    "checkpoint_every",
)
"""Fields that only the token-budgeted loop reads (refused without ``tokens``)."""


class RecoveryArgs(StageArgs, ChecksModel):
    if TYPE_CHECKING:  # declared by the arguments that derive from this base (lora, distill)
        batch_size: int
        seq_len: int
        learning_rate: float
        weight_decay: float
        dataset: str

    tokens: int | None = Field(None, ge=1)
    """Token budget: exactly this many input tokens are trained (the last batch truncated to it), on packed windows
    streamed from dataset or data_folder, with a held-out validation loss and checkpoints to resume from; None: the
    steps run (steps x batch_size random windows)."""
    data_folder: str | None = None
    """A local folder of .txt / .jsonl / .json / .parquet files to train on instead of dataset (tokens only)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Windows per forward/backward pass (gradient accumulation up to batch_size); None: the whole batch at once."""
    autocast: bool = False
    """Forward passes under bfloat16 autocast (for a model loaded in float32; a bfloat16 model runs so already)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after the warm-up: constant, or cosine decay to 0 at the budget's end."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient-norm clipping of each step (None: no clipping)."""
    validation_windows: int = Field(8, ge=0)
    """Held-out windows (the first of the data stream, never trained on) of the validation loss; 0: no validation."""
    validate_every: int = Field(0, ge=0)
    """Validation loss every this many steps (0: before and after training only)."""
    checkpoint_every: int = Field(0, ge=0)
    """A checkpoint every this many steps (0: only at the end); a killed run resumes from the last one."""

    @model_validator(mode="after")
    def _token_fields_need_tokens(self) -> RecoveryArgs:
        if self.tokens is None:
            fields = type(self).model_fields  # not model_fields_set: a parsed recipe re-validates its full dump
            given = [name for name in TOKEN_ONLY if getattr(self, name) != fields[name].default]
            if given:
                raise ValueError(f"{', '.join(given)}: only with tokens (the token-budgeted loop); set tokens")
        elif getattr(self, "steps", None) not in (None, 0):
            raise ValueError("steps and tokens: give one of them (steps 0 turns training off)")
        if self.data_folder is not None:
            folder_files(self.data_folder)  # a missing or empty folder is refused with the recipe
        return self

    def check_source(self, recipe: Recipe, source: dict[str, Any]) -> None:
        """Before any compute: every data file reads as its ending says, and the data gives the validation windows
        and one to train on (tokenised with the source's tokenizer; a model given in memory: the files only)."""
        super().check_source(recipe, source)
        if self.tokens is None:
            return
        if self.data_folder is not None:
            check_data_files(self.data_folder)
        if source.get("path") is not None:
            from slimkit.primitives.io.load import folder_tokenizer

            tokenizer = folder_tokenizer(source["path"])
            if tokenizer is not None:
                data = TextSource(self.dataset, self.data_folder, recipe.seed)
                check_windows(tokenizer, data, self.seq_len, self.validation_windows)


def recovery_config(args: RecoveryArgs, seed: int) -> RecoveryConfig:
    """The loop's settings from a stage's arguments (``tokens`` set)."""
    if args.tokens is None:
        raise ValueError("recovery_config needs a stage with tokens set")
    return RecoveryConfig(
        tokens=args.tokens,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        micro_batch_size=args.micro_batch_size,
        autocast=args.autocast,
        schedule=args.schedule,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        validation_windows=args.validation_windows,
        validate_every=args.validate_every,
        checkpoint_every=args.checkpoint_every,
        seed=seed,
    )


def checkpoint_folder(ctx: Context, label: str, args: RecoveryArgs) -> Path | None:
    """This stage's checkpoint folder under the run's checkpoint root, named by a hash of the recipe (everything
    before and in the stage decides what is trained) and of the input model's content, so a changed recipe or model
    never resumes another's checkpoint: training starts over, with a note naming the checkpoint not resumed."""
    if ctx.checkpoints is None:
        return None
    recipe = ctx.recipe.model_dump(mode="json")
    model = model_content_key(ctx.source.get("path"), ctx.model)
    key = json.dumps(
        {"recipe": recipe, "stage": label, "args": args.model_dump(mode="json"), "model": model}, sort_keys=True
    )
    folder = ctx.checkpoints / f"{label}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    others = sorted(p.name for p in ctx.checkpoints.glob(f"{label}-*") if p.is_dir() and p.name != folder.name)
    if others and not folder.exists():
        ctx.notes.append(
            f"{label}: the checkpoint {ctx.checkpoints / others[0]} was written for another recipe or input model "
            "(its weights' content differs), so it is not resumed; training starts over"
        )
    return folder


def run_token_budget(
    ctx: Context,
    label: str,
    args: RecoveryArgs,
    lora: LoraConfig | None,
    objective: TokenObjective,
    what: str,
    shard_units: list[nn.Module] | None = None,
) -> tuple[nn.Module, dict[str, Any], dict[str, ArtifactWriter]]:
    """The stage's token-budgeted recovery on ``ctx.model``: LoRA adapters of ``lora``, or every weight when it is
    None (sharded over the processes with ``shard_units`` as FSDP units when given); progress in tokens, a checkpoint
    folder under the run's output, a one-line note when it stopped early. Returns the trained model, its report and
    the loss curves' plot for the output folder (``LABEL-curves``)."""
    config = recovery_config(args, ctx.recipe.seed)
    source = TextSource(args.dataset, args.data_folder, ctx.recipe.seed)
    checkpoint = checkpoint_folder(ctx, label, args)
    with ctx.tracker.task(f"{label} (tokens)", config.tokens) as advance:

        def progress(step: int, tokens: int, result: RecoveryResult) -> None:
            advance(tokens)
            if args.validate_every and step % args.validate_every == 0 and result.validation_curve:
                rate = result.tokens / max(result.seconds, 1e-9)
                left = (config.tokens - result.tokens) / max(rate, 1e-9)
                ctx.tracker.log(
                    f"{label} step {step}/{config.budget.steps}: train loss {result.train_curve[-1][1]:.4f}, "
                    f"validation loss {result.validation_curve[-1][1]:.4f}, {rate:,.0f} tokens/s, "
                    f"{left:,.0f} s left"
                )

        if lora is None:
            model, report = recover_all_weights(
                ctx.model, ctx.tokenizer, config, source, objective, checkpoint, progress, shard_units
            )
        else:
            model, report = recover_in_tokens(
                ctx.model, ctx.tokenizer, lora, config, source, objective, checkpoint, progress, what
            )
    report["tokens_per_second"] = report["tokens"] / report["train_seconds"] if report["train_seconds"] else None
    report["checkpoint"] = None if checkpoint is None else checkpoint.name
    if report["stopped"]:
        note = f"{label} stopped early: {report['stopped']}; {report['tokens']:,} of {config.tokens:,} tokens trained"
        ctx.notes.append(note)
        ctx.tracker.log(note)
    artifacts: dict[str, ArtifactWriter] = {}
    if world()[0] == 0 and report["losses"]:
        written = dict(report)

        def curves(folder: Path) -> None:
            write_curves(written, folder, label)

        artifacts[f"{label}-curves"] = curves
    return model, report, artifacts


def write_curves(report: dict[str, Any], folder: Path, label: str) -> None:
    """``folder/loss.png``: the train loss per step and the validation loss against tokens trained; and
    ``folder/curves.json`` with the same numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    tokens_per_step = report["tokens_curve"]
    train = report["losses"]
    validation = report["validation"]
    step_tokens = [0, *tokens_per_step]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(tokens_per_step, train, label="train", linewidth=1)
    if validation:
        axis.plot(
            [step_tokens[v["step"]] for v in validation], [v["loss"] for v in validation], "o-", label="validation"
        )
    axis.set_xlabel("tokens trained")
    axis.set_ylabel("loss")
    axis.set_title(f"{label}: loss against tokens")
    axis.legend()
    figure.tight_layout()
    figure.savefig(folder / "loss.png", dpi=100)
    plt.close(figure)
    curves = {"tokens": tokens_per_step, "train": train, "validation": validation}
    (folder / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")


__all__ = ["TOKEN_ONLY", "RecoveryArgs", "checkpoint_folder", "recovery_config", "run_token_budget", "write_curves"]
