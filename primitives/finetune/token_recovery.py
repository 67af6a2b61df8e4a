"""LoRA recovery budgeted in tokens: adapters wrapped with peft, trained by
:class:`~slimkit.primitives.finetune.recovery.RecoveryRun` on any :class:`TokenObjective` (the LM loss, or
distillation from a teacher), then merged into the weights.

The adapters are initialised from the seed; a diverged run merges the last good adapters and says where it stopped
in its report (``stopped``). Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.finetune.lora import (
    LoraConfig,
    LoraTraining,
    check_targets,
    merge_lora,
    rng_devices,
    unwrap_lora,
    wrap_lora,
)
from slimkit.primitives.finetune.recovery import Progress, RecoveryConfig, RecoveryRun, TokenObjective
from slimkit.primitives.finetune.token_stream import TextSource


def recover_in_tokens(
    model: nn.Module,
    tokenizer,
    lora: LoraConfig,
    recovery: RecoveryConfig,
    source: TextSource,
    objective: TokenObjective,
    checkpoint: Path | None = None,
    progress: Progress | None = None,
    what: str = "lora training",
) -> tuple[nn.Module, dict[str, Any]]:
    """Train LoRA adapters of ``lora`` on ``model`` for ``recovery.tokens`` tokens of ``source`` minimising
    ``objective``, resuming from ``checkpoint`` when one is there; merge them. ``(model, report)``; ``model`` is
    changed in place (the returned model is the same object)."""
    check_targets(model, lora.target_modules)
    with torch.random.fork_rng(devices=rng_devices(model)):
        torch.manual_seed(recovery.seed)
        peft_model, base_requires_grad = wrap_lora(model, lora)
        try:
            trained: dict[str, torch.Tensor] = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
            run = RecoveryRun(peft_model, trained, objective, tokenizer, source, recovery, checkpoint)
            result = run.run(progress)
        except BaseException:
            unwrap_lora(peft_model, base_requires_grad, merge=False)
            raise
    report = {
        **result.report(),
        "budget_tokens": recovery.tokens,
        "data": source.describe(),
        "trainable_params": sum(t.numel() for t in trained.values()),
        "config": {**asdict(lora), **asdict(recovery), "steps": result.steps_done},
    }
    training = LoraTraining(peft_model, report, base_requires_grad, what=what)
    merged = merge_lora(training)
    report.pop("seconds", None)
    return merged, report


__all__ = ["recover_in_tokens"]
