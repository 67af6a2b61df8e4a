"""Full-parameter recovery budgeted in tokens: every weight of the student trained by
:class:`~slimkit.primitives.finetune.recovery.RecoveryRun` on any :class:`TokenObjective` (distillation from a
teacher, or the LM loss), replicated on every process (gradients all-reduced) or sharded over them (FSDP).

The weights train in float32 (the optimizer's master copy; a bfloat16 model's forward passes run under bfloat16
autocast, sharded ones on weights gathered in bfloat16) and are cast back to the model's dtype at the end. A diverged
run keeps the last good weights and says where it stopped. Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.device.moves import model_dtype
from slimkit.primitives.finetune.lora import rng_devices
from slimkit.primitives.finetune.recovery import Progress, RecoveryConfig, RecoveryRun, TokenObjective
from slimkit.primitives.finetune.sharding import gather_into, meta_skeleton, shard_model, to_float32
from slimkit.primitives.finetune.token_stream import TextSource


def recover_all_weights(
    model: nn.Module,
    tokenizer,
    recovery: RecoveryConfig,
    source: TextSource,
    objective: TokenObjective,
    checkpoint: Path | None = None,
    progress: Progress | None = None,
    shard_units: Sequence[nn.Module] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train every weight of ``model`` for ``recovery.tokens`` tokens of ``source`` minimising ``objective``,
    resuming from ``checkpoint`` when one is there. ``shard_units``: shard the model over the launched processes
    with these modules (the decoder layers) as FSDP units; None: the model is replicated. ``(model, report)``: the
    trained model in the dtype ``model`` came in (``model`` itself when replicated; a new module holding the gathered
    weights when sharded, ``model`` being left sharded)."""
    dtype = model_dtype(model)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    config = replace(recovery, autocast=recovery.autocast or dtype == torch.bfloat16)
    skeleton = meta_skeleton(model) if shard_units is not None else None
    with torch.random.fork_rng(devices=rng_devices(model)):
        torch.manual_seed(recovery.seed)
        if shard_units is not None:
            shard_model(model, shard_units, dtype if dtype == torch.bfloat16 else None)
        else:
            to_float32(model)
        model.requires_grad_(True)
        trained: dict[str, torch.Tensor] = dict(model.named_parameters())
        trainable = sum(p.numel() for p in trained.values())
        try:
            run = RecoveryRun(
                model, trained, objective, tokenizer, source, config, checkpoint, sharded=shard_units is not None
            )
            result = run.run(progress)
        finally:
            if skeleton is None:
                _restore(model, dtype, requires_grad)
        del run, trained
    if skeleton is not None:
        model = gather_into(model, skeleton, dtype)
    report = {
        **result.report(),
        "budget_tokens": recovery.tokens,
        "data": source.describe(),
        "trainable_params": trainable,
        "adapter": "none",
        "sharding": "fsdp" if shard_units is not None else "none",
        "config": {**asdict(config), "steps": result.steps_done},
    }
    return model, report


def _restore(model: nn.Module, dtype: torch.dtype, requires_grad: dict[str, bool]) -> None:
    """The replicated model back in its dtype with its parameters' ``requires_grad`` as they came in."""
    for name, param in model.named_parameters():
        param.grad = None
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
        param.requires_grad_(requires_grad.get(name, param.requires_grad))


__all__ = ["recover_all_weights"]
