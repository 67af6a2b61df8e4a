"""LoRA recovery fine-tuning: train low-rank adapters on a compressed model, then merge them in.

Adapters (peft) on the attention and MLP projections, base weights frozen; the data, steps and seeding come from
:class:`LoraConfig`.

Method note: docs/methods/finetune-lora-distill.md.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.loop import (
    Divergence,
    checked_backward,
    learning_rate_hint,
    name_list,
    non_finite_problem,
)

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``loss_fn(peft_model, batch) -> scalar loss`` of one batch of token ids ``[batch, seq_len]``."""

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """slimkit's LoRA recovery settings (not peft's ``LoraConfig``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = LLAMA_TARGETS
    learning_rate: float = 1e-4
    steps: int = 50  # optimizer steps
    batch_size: int = 4
    seq_len: int = 128
    dataset: str = "alpaca"  # a slimkit corpus name
    seed: int = 0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        object.__setattr__(self, "target_modules", targets)
        problems = []
        if self.rank < 1:
            problems.append(f"rank must be >= 1 (got {self.rank})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1) (got {self.dropout})")
        if not targets:
            problems.append("target_modules must name at least one module")
        for name in ("alpha", "learning_rate", "dropout", "weight_decay"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name} must be a finite number (got {getattr(self, name)})")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate must be > 0 (got {self.learning_rate})")
        if self.steps < 0:
            problems.append(f"steps must be >= 0 (got {self.steps})")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1 (got {self.batch_size})")
        if self.seq_len < 2:
            problems.append(f"seq_len must be >= 2 (got {self.seq_len})")
        if self.weight_decay < 0:
            problems.append(f"weight_decay must be >= 0 (got {self.weight_decay})")
        if problems:
            raise SlimkitError("lora: " + "; ".join(problems))


@dataclass
class LoraTraining:
    """A trained, not yet merged run: the peft-wrapped model and what :func:`merge_lora` restores."""

    peft_model: nn.Module
    report: dict[str, Any]
    base_requires_grad: dict[str, bool] = field(repr=False)
    started: float = field(repr=False, default=0.0)
    what: str = field(repr=False, default="lora training")
    """What the run is called in its divergence errors."""


def check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Raise :class:`SlimkitError` unless every target (a module name, or a full path, as peft matches them: the
    path itself or its ending after a dot) names only Linear layers of ``model``."""
    modules = [(name, module) for name, module in model.named_modules() if name]
    linears = sorted({name.rpartition(".")[2] for name, m in modules if isinstance(m, nn.Linear)})
    for target in targets:
        matched = [m for name, m in modules if name == target or name.endswith(f".{target}")]
        if not matched:
            raise SlimkitError(f"lora target module '{target}' not in the model; found: {', '.join(linears)}")
        if others := {type(m).__name__ for m in matched if not isinstance(m, nn.Linear)}:
            kind = ", ".join(sorted(others))
            raise SlimkitError(
                f"lora target module '{target}' names a {kind}, not only Linear layers; Linear layers: "
                f"{', '.join(linears)}"
            )


def rng_devices(model: nn.Module) -> list[int]:
    """The CUDA devices ``model`` lives on (what ``torch.random.fork_rng`` forks)."""
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def wrap_lora(model: nn.Module, config: LoraConfig) -> tuple[nn.Module, dict[str, bool]]:
    """``model`` wrapped with peft LoRA adapters of ``config`` (initialised from torch's random state), and each base
    parameter's ``requires_grad`` as it was (what unwrapping restores)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    base_requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft 0.21 calls transformers' deprecated `is_gradient_checkpointing` when wrapping.
        warnings.simplefilter("ignore", FutureWarning)
        # autocast_adapter_dtype (peft's default): float32 adapters over bfloat16/float16 base weights
        peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=True)
    return peft_model, base_requires_grad


def unwrap_lora(peft_model: nn.Module, base_requires_grad: dict[str, bool], merge: bool) -> nn.Module:
    """The plain model again: adapters merged into the base weights (``merge``) or dropped; eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = peft_model.merge_and_unload() if merge else peft_model.unload()
    for name, param in model.named_parameters():
        param.requires_grad_(base_requires_grad.get(name, param.requires_grad))
    return model.eval()


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of ``batch`` (labels are the input ids; the model shifts them)."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def train_lora(
    model: nn.Module,
    tokenizer,
    config: LoraConfig,
    progress: Callable[[int], None] | None = None,
    loss_fn: LossFn = lm_loss,
    what: str = "lora training",
) -> LoraTraining:
    """Wrap ``model`` with LoRA adapters and train them; :func:`merge_lora` finishes the run.

    ``progress(step)`` is called after each optimizer step (1-based). ``loss_fn`` (default: the causal-LM
    loss) is minimised; ``what`` names the run in divergence errors ("``what`` diverged at step N").
    """
    started = time.perf_counter()
    check_targets(model, config.target_modules)
    ids = None
    if config.steps > 0:
        spec = CalibrationSpec(config.dataset, config.steps * config.batch_size, config.seq_len, config.seed)
        ids = calibration_batches(tokenizer, spec)
    losses: list[float] = []
    with torch.random.fork_rng(devices=rng_devices(model)):
        torch.manual_seed(config.seed)
        peft_model, base_requires_grad = wrap_lora(model, config)
        try:
            params = [p for p in peft_model.parameters() if p.requires_grad]
            trainable = sum(p.numel() for p in params)
            if config.steps > 0:
                optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
                divergence = Divergence(what, learning_rate_hint(config.learning_rate))
                peft_model.train()
                for step in range(config.steps):
                    batch = to_input_device(model, ids[step * config.batch_size : (step + 1) * config.batch_size])
                    loss = loss_fn(peft_model, batch).float()
                    value = checked_backward(loss, step + 1, divergence, [optimizer])
                    optimizer.step()
                    losses.append(value)
                    if progress is not None:
                        progress(step + 1)
                optimizer.zero_grad(set_to_none=True)
                # the loss is checked before each update: the last update is checked here, on what it changed
                trained = ((name, p) for name, p in peft_model.named_parameters() if p.requires_grad)
                problem = non_finite_problem(trained, "adapter tensors")
                if problem:
                    raise divergence.error(config.steps, problem)
                peft_model.eval()
                with torch.no_grad():  # finite but huge adapters: the loss on the last batch after its update
                    after = float(loss_fn(peft_model, batch).float())
                if not math.isfinite(after):
                    raise divergence.error(config.steps, f"loss {after} after the update")
            peft_model.eval()
        except BaseException:
            unwrap_lora(peft_model, base_requires_grad, merge=False)
            raise
    report = {
        "steps": config.steps,
        "tokens": config.steps * config.batch_size * config.seq_len,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "trainable_params": trainable,
        "seconds": time.perf_counter() - started,
        "config": asdict(config),
    }
    return LoraTraining(peft_model, report, base_requires_grad, started, what)


def _merged_weights_finite(training: LoraTraining) -> list[str]:
    """The wrapped layers whose weight would hold NaN/inf once the adapters are merged (nothing is changed)."""
    from peft.tuners.lora import LoraLayer

    bad = []
    with torch.no_grad():
        for name, module in training.peft_model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            weight = module.get_base_layer().weight
            merged = weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    merged += module.get_delta_weight(adapter).to(merged.dtype)
            if not bool(torch.isfinite(merged).all()):
                bad.append(name.removeprefix("base_model.model."))
            del merged
    return bad


def merge_lora(training: LoraTraining) -> nn.Module:
    """Merge the trained adapters into the base weights; the plain model again, in eval mode.

    Refuses (:class:`SlimkitError`, the adapters removed unmerged, the model left as it was) when a
    merged weight would hold NaN/inf (an update too large for the base dtype).
    """
    bad = _merged_weights_finite(training) if training.report["steps"] > 0 else []
    if bad:
        unwrap_lora(training.peft_model, training.base_requires_grad, merge=False)
        config = training.report["config"]
        problem = f"merging the adapters makes {len(bad)} weights NaN/inf ({name_list(bad)})"
        raise Divergence(training.what, learning_rate_hint(config["learning_rate"])).error(config["steps"], problem)
    model = unwrap_lora(training.peft_model, training.base_requires_grad, merge=True)
    training.report["seconds"] = time.perf_counter() - training.started
    return model


def lora_recover(
    model: nn.Module, tokenizer, config: LoraConfig, progress: Callable[[int], None] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Train LoRA adapters on ``config.dataset`` for ``config.steps`` steps and merge them into ``model``.

    ``model`` is modified in place (peft's merge replaces each wrapped Linear by its base layer);
    the returned model is the same object. Returns ``(model, report)``.
    """
    training = train_lora(model, tokenizer, config, progress)
    return merge_lora(training), training.report
