"""GLUE dev-set metrics of a sequence-classification model (SST-2, MRPC, RTE, STS-B).

Method note: docs/methods/glue.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slimkit.primitives.datasets import gluedata
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import GLUE_BATCH_SIZE, GLUE_MAX_LENGTH


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    return float((predictions == labels).float().mean())


def f1_score(predictions: torch.Tensor, labels: torch.Tensor, positive: int = 1) -> float:
    tp = int(((predictions == positive) & (labels == positive)).sum())
    fp = int(((predictions == positive) & (labels != positive)).sum())
    fn = int(((predictions != positive) & (labels == positive)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks; tied values share the mean of their ranks."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    ranks = torch.empty_like(values)
    ranks[order] = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    unique, inverse = torch.unique(values, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    return pearson(average_ranks(x), average_ranks(y))


def glue_metrics(task: str, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The task's metrics from model outputs ``[n, num_labels]`` (or ``[n]`` for STS-B) and gold labels."""
    spec = gluedata.glue_task(task)
    if spec.regression:
        scores = outputs.reshape(-1)
        return {"spearman": spearman(scores, labels), "pearson": pearson(scores, labels)}
    predictions = outputs.argmax(dim=-1)
    metrics = {"accuracy": accuracy(predictions, labels)}
    if "f1" in spec.metrics:
        metrics["f1"] = f1_score(predictions, labels)
    return metrics


def check_task_model(model: nn.Module, task: str) -> None:
    """Raise :class:`SlimkitError` unless ``model`` is a sequence classifier with the task's label count."""
    spec = gluedata.glue_task(task)
    if not type(model).__name__.endswith("ForSequenceClassification"):
        raise SlimkitError(
            f"GLUE {task} needs a sequence-classification model, got {type(model).__name__}; "
            "give the recipe `task:` and fine-tune it (recipe glue-finetune)"
        )
    if model.config.num_labels != spec.num_labels:
        raise SlimkitError(f"GLUE {task} needs num_labels={spec.num_labels}, the model has {model.config.num_labels}")


def predict(
    model: nn.Module,
    tokenizer,
    examples: list[gluedata.GlueExample],
    batch_size: int = GLUE_BATCH_SIZE,
    max_length: int = GLUE_MAX_LENGTH,
    progress: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outputs, labels)``: the model's logits for ``examples`` (float32, on the CPU) and their labels."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    outputs, labels = [], []
    try:
        with torch.no_grad():
            for batch in gluedata.batches(tokenizer, examples, batch_size, max_length):
                labels.append(batch.pop("labels"))
                logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
                outputs.append(logits.float().cpu())
                if progress is not None:
                    progress(labels[-1].numel())
    finally:
        model.train(was_training)
    return torch.cat(outputs), torch.cat(labels)


def evaluate_glue(
    model: nn.Module,
    tokenizer,
    task: str,
    limit: int | None = None,
    batch_size: int = GLUE_BATCH_SIZE,
    max_length: int = GLUE_MAX_LENGTH,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Dev-set metrics of ``task``: ``{task, examples, max_length, seconds, <metric>: value, ...}``."""
    check_task_model(model, task)
    started = time.perf_counter()
    examples = gluedata.load_examples(task, "dev", limit)
    outputs, labels = predict(model, tokenizer, examples, batch_size, max_length, progress)
    return {
        "task": task,
        "examples": len(examples),
        "max_length": max_length,
        **glue_metrics(task, outputs, labels),
        "seconds": time.perf_counter() - started,
    }
