"""Training SP3's masks with the weights, then binarising and fusing them (SP3 §3.2, §3.3, Appendix F).

:func:`train_stream_masks` is the LLM setting: one gate per Group PCA group on the residual stream and the FFN filter
gates, trained with the Lagrangian, then binarised to the target and sliced away.

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.capabilities import check_operation
from slimkit.primitives.device.moves import input_device, to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.fusing import fuse_stream_masks, stream_count_args
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, apply_rank_prior
from slimkit.primitives.masks.mask_settings import StreamMaskSettings
from slimkit.primitives.masks.sparsity import binarize, stream_model_size
from slimkit.primitives.masks.training import MaskTarget, run_settings, train_masks


def _kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return (
        F.kl_div(
            F.log_softmax(student.float(), -1),
            F.log_softmax(teacher.float(), -1),
            log_target=True,
            reduction="batchmean",
        )
        / student.shape[1]
    )


def train_stream_masks(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    settings: StreamMaskSettings,
    target: MaskTarget,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Train, binarise and fuse SP3's stream and FFN masks on ``model`` in place; returns a report.

    ``batches`` are token-id tensors ``[batch, seq]``, one per optimiser step (reused cyclically
    when fewer). ``target``: the fraction of the dense model's parameters to remove (``target.total``). See the
    module docstring for the loss, the count and the schedule.
    """
    started = time.perf_counter()
    view = ModelView(model)
    if view.spec.norm_placement == "post":
        raise SlimkitError("mask training on the residual stream needs a pre-norm decoder (llama, OPT)")
    check_operation(view.spec, "hidden_masks")
    if not batches:
        raise SlimkitError("mask training needs token batches")
    shape = MaskShape.from_view(view)
    count = stream_count_args(model)
    groups = count["groups"]
    masks = MaskSet(
        shape,
        head=False,
        layer=False,
        intermediate=False,
        hidden="per_group" if settings.hidden else "none",
        groups=groups if settings.hidden else None,
        init_drop=settings.init_drop,
        seed=seed,
    ).to(input_device(model))  # float32 gates on the model's device (sampled with a seeded CPU generator)
    if settings.rank_prior > 0:
        apply_rank_prior(masks, settings.rank_prior)
    size = lambda values: stream_model_size(values, shape, **count)  # noqa: E731
    schedule = settings.schedule()
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if settings.distill > 0 else None

    def step_loss(net: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = to_input_device(net, ids)
        if net is teacher:  # only its logits are used: no language-model loss over the vocabulary
            return torch.zeros((), device=ids.device), net(input_ids=ids, use_cache=False).logits
        out = net(input_ids=ids, labels=ids, use_cache=False)
        return out.loss.float(), out.logits

    hooks = apply_masks(
        model, masks, groups=groups if settings.hidden else None, placement="stream" if settings.hidden else "linear"
    )
    try:
        history, lagrangian = train_masks(
            model,
            masks,
            batches,
            schedule,
            size,
            step_loss,
            settings,
            target,
            seed=seed,
            teacher=teacher,
            distance=_kl,
            progress=progress,
        )
    finally:
        hooks.remove()
    masks.set_active(("dimension",))
    binary = binarize(masks.scores(), shape, target.ratio, total=target.total, residual="none", size=size)
    final = binary.masks if settings.kept_value == "one" else masks.kept_values().times(binary.masks)
    fused = fuse_stream_masks(model, final)
    params = ModelView(model).num_params()
    return {
        "steps": settings.total_steps,
        "finetune_steps": settings.finetune_steps,
        "mask_steps": settings.mask_steps,
        "seconds": time.perf_counter() - started,
        "seconds_per_step": (time.perf_counter() - started) / max(settings.total_steps, 1),
        "task_loss_first": history["task_loss"][0],
        "task_loss_last": history["task_loss"][-1],
        "expected_sparsity_last": history["expected_sparsity"][-1] if history["expected_sparsity"] else None,
        "lambda_1": float(lagrangian.lambda_1.detach()),
        "lambda_2": float(lagrangian.lambda_2.detach()),
        "threshold": binary.threshold,
        "binary_sparsity": binary.sparsity,
        "params": params,
        "achieved_sparsity": 1.0 - params / target.total,
        "fused": fused,
        "history": history,
        "config": run_settings(settings, StreamMaskSettings, target, seed),
    }


__all__ = ["train_stream_masks"]
