"""``lora`` (model scope): LoRA recovery fine-tuning with peft, merged into the weights."""

from __future__ import annotations

from pydantic import Field, field_validator

from slimkit.primitives.finetune import LoraConfig, lora_recover
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict, check_corpus


class LoraArgs(Strict):
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None
    """Linear module names to adapt; None: every attention and MLP projection of the layers."""
    learning_rate: float = Field(1e-4, gt=0)
    steps: int = Field(50, ge=0)
    batch_size: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    dataset: str = "alpaca"
    weight_decay: float = Field(0.0, ge=0.0)

    _dataset = field_validator("dataset")(check_corpus)


def default_lora_targets(ctx: Context) -> tuple[str, ...]:
    """Every projection of the layers by name; low-rank pairs are adapted through their two factors
    (peft wraps Linear layers only), LoRAP's "LoRA on both pruned linears and low-rank factors"."""
    names: set[str] = set()
    for layer in ctx.view.layers:
        for role in layer.roles:
            module = layer.linear(role)
            if isinstance(module, LowRankLinear):
                names.update(("first", "second"))
            else:
                names.add(layer.linear_path(role).rsplit(".", 1)[-1])
    return tuple(sorted(names))


@register_stage("lora", args=LoraArgs, scope="model")
def lora(ctx: Context, args: LoraArgs) -> None:
    """Recover with LoRA adapters (peft) trained on a local corpus, then merge them into the weights."""
    values = args.model_dump()
    values["target_modules"] = tuple(args.target_modules or default_lora_targets(ctx))
    config = LoraConfig(**values, seed=ctx.recipe.seed)
    with ctx.tracker.task("lora", config.steps) as advance:
        ctx.model, report = lora_recover(ctx.model, ctx.tokenizer, config, progress=lambda _step: advance(1))
    ctx.stage_report["lora"] = report
