"""GLUE task models: a sequence classifier built from an encoder, and full fine-tuning on a task.

:func:`task_model` builds the task model around an encoder of any per-layer widths; the fine-tuning trains every
weight.

Method note: docs/methods/glue.md.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from torch import nn

from slimkit.primitives.datasets import gluedata
from slimkit.primitives.device.moves import model_dtype, to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.glue_metrics import check_task_model
from slimkit.primitives.finetune.loop import (
    Divergence,
    FloatMaster,
    checked_backward,
    learning_rate_hint,
    master_step,
    non_finite_problem,
)


@dataclass(frozen=True)
class TaskHead:
    """What a recipe's ``task`` makes of the loaded encoder, and what such a model cannot do: the run builds it with
    :meth:`wrap` right after loading, and names it in the refusals of what it cannot take."""

    task: str

    @property
    def what(self) -> str:
        """The model, as refusals name it."""
        return f"a GLUE {self.task} task model"

    @property
    def no_dense_comparison(self) -> str:
        """Why the run compares no dense metrics beside its own."""
        return "a GLUE task model's dense head is untrained"

    def wrap(self, model: nn.Module, seed: int) -> nn.Module:
        """The task model around ``model`` (:func:`task_model`)."""
        return task_model(model, self.task, seed=seed)


def task_head(task: str | None) -> TaskHead | None:
    """The task head of a recipe's ``task`` (None: the model is used as it is loaded)."""
    return TaskHead(task) if task is not None else None


def is_task_model(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def _classifier_class(model: nn.Module) -> type:
    mapping = transformers.AutoModelForSequenceClassification._model_mapping
    try:
        return mapping[type(model.config)]
    except KeyError:
        raise SlimkitError(
            f"model type '{model.config.model_type}' has no sequence-classification model in transformers"
        ) from None


def task_model(model: nn.Module, task: str, seed: int = 0) -> nn.Module:
    """A sequence classifier for GLUE ``task`` around the encoder ``model`` (see the module docstring)."""
    spec = gluedata.glue_task(task)
    if is_task_model(model):
        check_task_model(model, task)
        recorded = getattr(model.config, "finetuning_task", None)
        if recorded not in (None, task):
            raise SlimkitError(f"the model was fine-tuned for GLUE {recorded}, not {task}; use a {task} model")
        model.config.finetuning_task = task
        return model
    if getattr(model, "base_model", None) is not model:
        raise SlimkitError(f"GLUE tasks need an encoder model (e.g. minilm-l6, BERT), got {type(model).__name__}")
    cls = _classifier_class(model)
    config = copy.deepcopy(model.config)
    config.num_labels = spec.num_labels
    names = spec.label_names or ("score",)
    config.id2label = dict(enumerate(names))
    config.label2id = {name: index for index, name in enumerate(names)}
    config.problem_type = "regression" if spec.regression else "single_label_classification"
    config.finetuning_task = task
    config.architectures = [cls.__name__]
    device, dtype = next(model.parameters()).device, model_dtype(model)
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        torch.manual_seed(seed)
        classifier = cls(config)  # initialised in float32 on the CPU (seeded), then moved to the encoder's
    fresh_base = getattr(classifier, classifier.base_model_prefix)
    if hasattr(model, "pooler"):
        model.pooler = fresh_base.pooler
    setattr(classifier, classifier.base_model_prefix, model)
    model.config = classifier.config
    return classifier.to(device=device, dtype=dtype).eval()  # the new head and pooler in the encoder's dtype


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


@dataclass(frozen=True)
class GlueFinetuneConfig:
    task: str
    learning_rate: float = 2e-5
    epochs: float = 3.0
    max_steps: int | None = 250
    """Optimizer steps at most (None: ``epochs`` alone decides; 0: no training)."""
    batch_size: int = 32
    max_length: int = 128
    train_examples: int | None = None
    """A seeded subset of the train split (None: all of it)."""
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        gluedata.glue_task(self.task)
        problems = []
        for name in ("learning_rate", "epochs", "weight_decay", "warmup_ratio", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                problems.append(f"{name} must be a finite number (got {value})")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate must be > 0 (got {self.learning_rate})")
        if not self.epochs > 0:
            problems.append(f"epochs must be > 0 (got {self.epochs})")
        if self.max_steps is not None and self.max_steps < 0:
            problems.append(f"max_steps must be >= 0 (got {self.max_steps})")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1 (got {self.batch_size})")
        if self.max_length < 8:
            problems.append(f"max_length must be >= 8 (got {self.max_length})")
        if self.train_examples is not None and self.train_examples < 1:
            problems.append(f"train_examples must be >= 1 (got {self.train_examples})")
        if self.weight_decay < 0:
            problems.append(f"weight_decay must be >= 0 (got {self.weight_decay})")
        if not 0.0 <= self.warmup_ratio < 1.0:
            problems.append(f"warmup_ratio must be in [0, 1) (got {self.warmup_ratio})")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            problems.append(f"max_grad_norm must be > 0 (got {self.max_grad_norm})")
        if problems:
            raise SlimkitError("glue_finetune: " + "; ".join(problems))

    def total_steps(self, train_examples: int) -> int:
        steps = math.ceil(self.epochs * math.ceil(train_examples / self.batch_size))
        return steps if self.max_steps is None else min(steps, self.max_steps)


def _optimizer(params: list[torch.Tensor], config: GlueFinetuneConfig) -> torch.optim.AdamW:
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.999), eps=1e-8, fused=fused)


def _schedule(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _check_last_update(model: nn.Module, batch: dict, master: FloatMaster, divergence: Divergence, step: int) -> None:
    """The per-step check reads the loss before each update; this checks what the last update made."""
    trained = {id(p) for p, _master in master.pairs}
    problem = non_finite_problem(((name, p) for name, p in model.named_parameters() if id(p) in trained), "weights")
    if problem:
        raise divergence.error(step, problem)
    model.eval()
    with torch.no_grad():
        after = float(model(**to_input_device(model, batch)).loss.float())
    if not math.isfinite(after):
        raise divergence.error(step, f"loss {after} after the update")


def finetune_glue(
    model: nn.Module, tokenizer, config: GlueFinetuneConfig, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Fine-tune every parameter of ``model`` on ``config.task``'s train split in place; returns the report.

    ``progress(step)`` is called after each optimizer step (1-based).
    """
    started = time.perf_counter()
    check_task_model(model, config.task)
    seeded = config.seed if config.train_examples is not None else None
    examples = gluedata.load_examples(config.task, "train", config.train_examples, seeded)
    total = config.total_steps(len(examples))
    losses: list[float] = []
    seen = tokens = 0
    # bfloat16/float16 weights are trained through float32 master copies (AdamW state in float32)
    master = FloatMaster([p for p in model.parameters() if p.requires_grad])
    divergence = Divergence("glue_finetune", learning_rate_hint(config.learning_rate))
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        torch.manual_seed(config.seed)
        if total > 0:
            optimizer = _optimizer(master.params, config)
            schedule = _schedule(optimizer, total, int(config.warmup_ratio * total))
            model.train()
        try:
            epoch = 0
            while len(losses) < total:
                order = gluedata.training_order(len(examples), config.seed, epoch)
                for start in range(0, len(order), config.batch_size):
                    if len(losses) >= total:
                        break
                    chosen = [examples[i] for i in order[start : start + config.batch_size]]
                    batch = gluedata.encode(tokenizer, chosen, config.max_length)
                    loss = model(**to_input_device(model, batch)).loss.float()
                    value = checked_backward(loss, len(losses) + 1, divergence, [optimizer, model])
                    master_step(master, optimizer, config.max_grad_norm)
                    schedule.step()
                    losses.append(value)
                    seen += len(chosen)
                    tokens += (
                        int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
                    )
                    if progress is not None:
                        progress(len(losses))
                epoch += 1
            if total > 0:
                optimizer.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
                _check_last_update(model, batch, master, divergence, len(losses))
        finally:
            model.eval()
    seconds = time.perf_counter() - started
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "task": config.task,
        "steps": len(losses),
        "epochs": seen / len(examples),
        "train_examples": len(examples),
        "examples_seen": seen,
        "tokens": tokens,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "loss_tail": sum(tail) / len(tail) if losses else None,
        "losses": losses,
        "seconds": seconds,
        "seconds_per_step": seconds / len(losses) if losses else None,
        "config": asdict(config),
    }
