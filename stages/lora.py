"""``lora`` (model scope): LoRA recovery fine-tuning with peft, merged into the weights."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs, training_memory
from slimkit.primitives.device.memory_model import FLOAT32, StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import check_corpus
from slimkit.primitives.finetune import LoraConfig, lora_recover
from slimkit.primitives.finetune.lora import check_targets
from slimkit.primitives.finetune.recovery import LanguageModelObjective
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.stages.recovery_settings import TOKEN_ONLY, RecoveryArgs, run_token_budget

MAX_LEARNING_RATE = 1.0
"""The largest learning rate a training stage takes: AdamW moves each parameter by about the learning rate per
step, and no fine-tuning of a pretrained model moves weights by more than 1 per step."""
LOW_RANK_FACTORS = ("first", "second")
"""The names of a low-rank pair's two factors (:class:`~slimkit.primitives.lowrank.LowRankLinear`)."""

DEFAULT_STEPS = 50
"""Optimizer steps of a run given neither steps nor tokens."""


class LoraArgs(RecoveryArgs, ChecksModel, PlansMemory):
    rank: int = Field(8, ge=1)
    """Rank r of every adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapters' input during training, in [0, 1)."""
    target_modules: list[str] | None = None
    """Linear module names to adapt; None: every attention and MLP projection of the layers."""
    learning_rate: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE)
    """AdamW learning rate of the adapter parameters (constant; base weights stay frozen), in (0, 1]."""
    steps: int | None = Field(None, ge=0)
    """Optimizer steps of the run without tokens (None: 50); 0: no training, the model is left as it is (also with
    tokens)."""
    batch_size: int = Field(4, ge=1)
    """Token windows per optimizer step."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training window."""
    dataset: str = "alpaca"
    """Local corpus the training windows are drawn from: wikitext2, ptb, c4 or alpaca."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay of the adapter parameters (0: none)."""

    _dataset = field_validator("dataset")(check_corpus)

    def check_model(self, model: Any) -> None:
        """The rank and the named modules against the loaded model, before any stage runs (not when training
        starts, after the pruning stages; the training windows' ``seq_len`` is checked for every stage by
        :func:`~slimkit.engine.preflight.check_stage_models`)."""
        name = type(self).__name__.removesuffix("Args").lower()
        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", None)
        if isinstance(hidden, int) and self.rank > hidden:
            raise SlimkitError(
                f"{name}: rank {self.rank} is more than the model's hidden size {hidden}; every adapted projection "
                f"has the hidden size on one side, so an adapter's rank is at most {hidden}"
            )
        if self.target_modules:
            # low-rank factors (first, second) exist only once a lowrank stage has made them
            named = tuple(t for t in self.target_modules if t not in LOW_RANK_FACTORS)
            try:
                check_targets(model, named)
            except SlimkitError as error:
                raise SlimkitError(f"{name}: target_modules: {error}") from None

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The backward's activations at the stage's own micro-batch, and the float32 adapters with their gradients,
        AdamW's two moments and the last good copy."""
        memory = training_memory(stage, inputs, self.micro_batch_size or self.batch_size, self.seq_len)
        shape = inputs.shape
        linears = 4 * (shape.hidden + shape.q_width) + 3 * (shape.hidden + shape.intermediate)
        memory.parts["adapters"] = shape.layers * self.rank * linears * FLOAT32 * 5
        return memory

    def trains(self) -> bool:
        """Whether the stage trains at all (``steps: 0`` turns it off)."""
        return self.steps != 0


def default_lora_targets(ctx: Context) -> tuple[str, ...]:
    """Every projection of the layers by name; low-rank pairs are adapted through their two factors
    (peft wraps Linear layers only), LoRAP's "LoRA on both pruned linears and low-rank factors". A projection
    name that is low-rank in some layers and dense in others (a global rank allocation) is named by its dense
    modules' full paths, so peft never meets a low-rank pair under that name."""
    names: set[str] = set()
    dense: dict[str, list[str]] = {}
    lowrank: set[str] = set()
    view = ctx.view
    # A routed-expert family's MLP projections share their names with fused expert tensors, which peft re-targets
    # as parameters (its transformers-v5 MoE conversion); such a model is adapted in its attention only.
    skipped = {"gate", "up", "down"} if view.spec.experts is not None else set()
    for layer in view.layers:
        for role in (r for r in layer.roles if r not in skipped):
            path = view.path_of(layer.linear(role))
            suffix = path.rsplit(".", 1)[-1]
            if isinstance(layer.linear(role), LowRankLinear):
                names.update(("first", "second"))
                lowrank.add(suffix)
            else:
                dense.setdefault(suffix, []).append(path)
    for suffix, paths in dense.items():
        names.update(paths if suffix in lowrank else (suffix,))
    return tuple(sorted(names))


def lora_config(ctx: Context, args: LoraArgs, exclude: set[str] | None = None) -> LoraConfig:
    """The adapters' settings (and the steps run's) from a stage's arguments."""
    skipped = {"tokens", *TOKEN_ONLY, *(exclude or ())}
    values = args.model_dump(exclude=skipped)
    values["steps"] = DEFAULT_STEPS if args.steps is None else args.steps
    values["target_modules"] = tuple(args.target_modules or default_lora_targets(ctx))
    return LoraConfig(**values, seed=ctx.recipe.seed)


@register_stage("lora", args=LoraArgs, trains=True, paper="LoRA (Hu et al. 2022) recovery, merged into the weights")
class Lora:
    """Recover with LoRA adapters (peft) trained on a local corpus, then merge them into the weights."""

    def run_model(self, ctx: Context, args: LoraArgs) -> StageResult:
        config = lora_config(ctx, args)
        if args.tokens is not None and config.steps > 0:
            objective = LanguageModelObjective()
            ctx.model, report, artifacts = run_token_budget(ctx, "lora", args, config, objective, "lora training")
            return StageResult(report, artifacts=artifacts)
        with ctx.tracker.task("lora", config.steps) as advance:
            ctx.model, report = lora_recover(ctx.model, ctx.tokenizer, config, progress=lambda _step: advance(1))
        return StageResult(report)
