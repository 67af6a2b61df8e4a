"""The one training loop of SP3's masks: task loss + Lagrangian (Eq. 14), weights and masks together.

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimkit.primitives.device.moves import input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.loop import Divergence, FloatMaster, checked_backward, master_step, non_finite_problem
from slimkit.primitives.masks.mask_set import MaskSet, MaskValues
from slimkit.primitives.masks.mask_settings import MaskSettings
from slimkit.primitives.masks.schedule import MaskSchedule
from slimkit.primitives.masks.sparsity import Lagrangian, lagrangian_optimizer

StepLoss = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
"""``(model, batch) -> (task loss, logits)``."""
Distance = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(student logits, teacher logits) -> distillation loss``."""


@dataclass(frozen=True)
class MaskTarget:
    """What the masks are trained towards: remove ``ratio`` of ``total`` (the count ``ŝ`` is relative to)."""

    ratio: float
    total: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and 0.0 < self.ratio < 1.0):
            raise SlimkitError(f"mask training: target must be in (0, 1), got {self.ratio}")
        if not (math.isfinite(self.total) and self.total > 0):
            raise SlimkitError(f"mask training: the count the target is a fraction of must be > 0, got {self.total}")


MAX_GRAD_NORM = 1.0
"""The weights' gradient-norm clip of every mask-training run."""
DIVERGENCE = Divergence("mask training", "lower the learning rates")


@contextlib.contextmanager
def frozen_weights(model: nn.Module, frozen: bool) -> Iterator[None]:
    """With ``frozen``, the model's trainable parameters stop requiring gradients for the block (restored after):
    a masks-only run then computes no weight gradient it would discard (a model-sized buffer and about a third of
    the backward's work)."""
    params = [p for p in model.parameters() if p.requires_grad] if frozen else []
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def train_masks(
    model: nn.Module,
    masks: MaskSet,
    batches: Sequence[Any],
    schedule: MaskSchedule,
    size: Callable[[MaskValues], torch.Tensor],
    step_loss: StepLoss,
    settings: MaskSettings,
    target: MaskTarget,
    seed: int = 0,
    max_grad_norm: float | None = MAX_GRAD_NORM,
    teacher: nn.Module | None = None,
    distance: Distance | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[float]], Lagrangian]:
    """Run ``schedule.total_steps`` optimiser steps (batches reused cyclically); returns the history and multipliers.

    The mask hooks must already be on ``model``. With ``settings.distill > 0``, ``teacher`` (a
    frozen copy of the model taken *before* the hooks were added) is compared by ``distance``. With
    ``settings.learning_rate == 0`` the weights are frozen for the run (:func:`frozen_weights`) and a step with
    nothing to train (fine-tuning steps) runs no backward: the same results without the unused weight gradients.
    """
    if settings.distill > 0 and (teacher is None or distance is None):
        raise SlimkitError("distillation needs a teacher model and a distance between their logits")
    teacher = teacher if settings.distill > 0 else None
    mask_params = [p for p in masks.parameters() if p.requires_grad]
    device = mask_params[0].device if mask_params else input_device(model)
    lagrangian = Lagrangian().to(device)
    weights = [p for p in model.parameters() if p.requires_grad] if settings.learning_rate > 0 else []
    master = FloatMaster(weights)  # float32 copies of bfloat16/float16 weights for AdamW
    weight_opt = torch.optim.AdamW(master.params, lr=settings.learning_rate, weight_decay=0.0) if weights else None
    mask_opt = torch.optim.AdamW(mask_params, lr=settings.mask_learning_rate, weight_decay=0.0)
    lagrangian_opt = lagrangian_optimizer(lagrangian, settings.lagrangian_learning_rate)
    optimizers = [opt for opt in (weight_opt, mask_opt, lagrangian_opt) if opt is not None]
    history: dict[str, list[float]] = {"loss": [], "task_loss": [], "expected_sparsity": [], "target": []}
    with torch.random.fork_rng(), frozen_weights(model, settings.learning_rate == 0):
        torch.manual_seed(seed)
        try:
            model.train()
            masks.train()
            for step in range(schedule.total_steps):
                levels = schedule.levels(step)
                masks.set_active(levels)
                batch = batches[step % len(batches)]
                task, logits = step_loss(model, batch)
                loss = task.float()
                if teacher is not None:
                    with torch.no_grad():
                        reference = step_loss(teacher, batch)[1]
                    loss = loss + settings.distill * distance(logits, reference)
                if levels:
                    now = schedule.target(step, target.ratio)
                    s_hat = 1.0 - size(masks.keep_probs()) / target.total
                    loss = loss + lagrangian(s_hat, now).float()
                    history["target"].append(now)
                    history["expected_sparsity"].append(float(s_hat.detach()))
                if loss.requires_grad:
                    # with float32 masters the optimiser does not see the model's grads: clear those too
                    value = checked_backward(loss, step + 1, DIVERGENCE, [*optimizers, model])
                else:  # frozen weights and no active gates: nothing to update in this step
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        raise DIVERGENCE.error(step + 1, f"loss {value}")
                if weight_opt is not None:
                    master_step(master, weight_opt, max_grad_norm)
                if levels:
                    mask_opt.step()
                    lagrangian_opt.step()
                history["loss"].append(value)
                history["task_loss"].append(float(task.detach()))
                if progress is not None:
                    progress(step + 1)
            # the loss is checked before each update; what the last update changed is checked here
            weight_ids = {id(w) for w in weights}
            trained = [
                *((f"weight {name}", p) for name, p in model.named_parameters() if id(p) in weight_ids),
                *((f"gate {name}", p) for name, p in masks.named_parameters() if p.requires_grad),
                *((f"multiplier {name}", p) for name, p in lagrangian.named_parameters()),
            ]
            problem = non_finite_problem(trained, "tensors")
            if problem:
                raise DIVERGENCE.error(schedule.total_steps, problem)
            model.eval()
            masks.eval()
            with torch.no_grad():  # finite but huge weights: the task loss on the last batch after its update
                after = float(step_loss(model, batches[(schedule.total_steps - 1) % len(batches)])[0].float())
            if not math.isfinite(after):
                raise DIVERGENCE.error(schedule.total_steps, f"task loss {after} after the update")
        finally:
            model.eval()
            masks.eval()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
    return history, lagrangian


def run_settings(settings: MaskSettings, kind: type[MaskSettings], target: MaskTarget, seed: int) -> dict:
    """What a report records as the run's settings: ``kind``'s fields of ``settings`` (a stage's arguments may
    hold more), the target and its count, the clip and the seed."""
    own = {name: getattr(settings, name) for name in kind.model_fields}
    return {**own, "target": target.ratio, "total": target.total, "max_grad_norm": MAX_GRAD_NORM, "seed": seed}


__all__ = ["MAX_GRAD_NORM", "MaskTarget", "frozen_weights", "run_settings", "train_masks"]
