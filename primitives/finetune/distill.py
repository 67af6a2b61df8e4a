"""Recovery by distillation: LoRA adapters trained against a dense teacher's logits instead of the LM loss.

The run is :func:`~slimkit.primitives.finetune.lora.train_lora` with a distillation loss; everything else is the
same.

Method note: docs/methods/finetune-lora-distill.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.lora import LoraConfig, merge_lora, train_lora


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` ``[batch, seq]`` over the positions where ``mask`` is true (all when None)."""
    if mask is None:
        return values.mean()
    mask = mask.to(device=values.device, dtype=values.dtype)
    count = mask.sum()
    if not bool(count > 0):
        raise SlimkitError("distillation loss: the mask selects no token")
    return (values * mask).sum() / count


KL_CHUNK_TOKENS = 1024
"""Tokens per chunk of :func:`distill_loss`: its float32 softmax temporaries are ``chunk x vocab`` at a time."""


def _token_kl(student_chunk: torch.Tensor, teacher_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token KL(teacher || student) of ``[tokens, vocab]`` logits at ``temperature``, in float32."""
    teacher_log_p = F.log_softmax(teacher_chunk.float() / temperature, dim=-1)
    student_log_p = F.log_softmax(student_chunk.float() / temperature, dim=-1)
    return (teacher_log_p.exp() * (teacher_log_p - student_log_p)).sum(dim=-1)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_tokens: int = KL_CHUNK_TOKENS,
) -> torch.Tensor:
    """Forward KL(teacher || student) per token at ``temperature``, times ``temperature**2``, averaged over tokens.

    ``student_logits`` and ``teacher_logits``: ``[batch, seq, vocab]`` (same shape); ``mask``: ``[batch, seq]``,
    true for the tokens that count (None: all). Float32 whatever the inputs' dtype; gradients flow to the
    student only through ``student_logits`` (the teacher's are used as given: detach them or compute them
    under ``no_grad``).

    Memory: the tokens go through in chunks of ``chunk_tokens``, each recomputed in the backward pass
    (activation checkpointing), so the float32 softmax temporaries live for one chunk at a time
    (``chunk_tokens x vocab x 4`` bytes each) instead of for every token: at a 128k vocabulary and 4 x 2,048
    tokens that is 0.5 GB per temporary instead of 4.2 GB. The value equals the unchunked one.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise SlimkitError(f"distillation loss: temperature must be a finite number > 0 (got {temperature})")
    if student_logits.shape != teacher_logits.shape:
        raise SlimkitError(
            f"distillation loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape (the two models must share the vocabulary)"
        )
    if chunk_tokens < 1:
        raise SlimkitError(f"distillation loss: chunk_tokens must be at least 1 (got {chunk_tokens})")
    vocab = student_logits.shape[-1]
    student_rows = student_logits.reshape(-1, vocab)
    teacher_rows = teacher_logits.reshape(-1, vocab)
    chunks = []
    for start in range(0, student_rows.shape[0], chunk_tokens):
        end = start + chunk_tokens
        student_chunk, teacher_chunk = student_rows[start:end], teacher_rows[start:end]
        if student_chunk.requires_grad:
            chunks.append(checkpoint(_token_kl, student_chunk, teacher_chunk, temperature, use_reentrant=False))
        else:
            chunks.append(_token_kl(student_chunk, teacher_chunk, temperature))
    per_token = torch.cat(chunks).reshape(student_logits.shape[:-1])
    return _masked_mean(per_token, mask) * temperature**2


def hidden_mse(
    student_hidden: tuple[torch.Tensor, ...] | list[torch.Tensor],
    teacher_hidden: tuple[torch.Tensor, ...] | list[torch.Tensor],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared error of the student's hidden states against the teacher's, normalised per layer, averaged.

    For each layer ``l``: mean over tokens of ``||h_s - h_t||^2`` divided by the mean over tokens of
    ``||h_t||^2`` (a relative error: 0 for equal states, 1 for a student state of zeros); then the mean over
    layers. Inputs are ``[batch, seq, hidden]`` per layer; float32 whatever their dtype.
    """
    if len(student_hidden) != len(teacher_hidden) or not teacher_hidden:
        raise SlimkitError(
            f"distillation hidden-state term: the student has {len(student_hidden)} hidden states and the teacher "
            f"{len(teacher_hidden)}; it needs the same layer count (set hidden_weight: 0 for models whose layers "
            "were removed)"
        )
    terms = []
    for index, (student, teacher) in enumerate(zip(student_hidden, teacher_hidden, strict=True)):
        if student.shape != teacher.shape:
            raise SlimkitError(
                f"distillation hidden-state term: layer {index} hidden states differ in shape (student "
                f"{tuple(student.shape)}, teacher {tuple(teacher.shape)}); set hidden_weight: 0 for models whose "
                "hidden width changed"
            )
        teacher = teacher.float()
        error = _masked_mean((student.float() - teacher).pow(2).sum(dim=-1), mask)
        power = _masked_mean(teacher.pow(2).sum(dim=-1), mask).detach()
        terms.append(error / power.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.stack(terms).mean()


@dataclass(frozen=True)
class DistillConfig:
    """The distillation loss's settings (the training run's are :class:`LoraConfig`)."""

    temperature: float = 1.0
    hidden_weight: float = 0.0  # 0: logits only

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            problems.append(f"temperature must be a finite number > 0 (got {self.temperature})")
        if not (math.isfinite(self.hidden_weight) and self.hidden_weight >= 0):
            problems.append(f"hidden_weight must be a finite number >= 0 (got {self.hidden_weight})")
        if problems:
            raise SlimkitError("distill: " + "; ".join(problems))


@dataclass
class DistillObjective:
    """The loss hook of :func:`train_lora`: one teacher forward (``no_grad``) and one student forward per call.

    Calls in train mode (the training steps) append their terms to ``kls`` / ``hiddens``; the eval-mode call
    (train_lora's after-update check) sets ``kl_after`` / ``hidden_after`` instead.
    """

    teacher: nn.Module
    config: DistillConfig
    kls: list[float] = field(default_factory=list)
    hiddens: list[float] = field(default_factory=list)
    kl_after: float | None = None
    hidden_after: float | None = None

    def __call__(self, student: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with_hidden = self.config.hidden_weight > 0
        with torch.no_grad():
            teacher_out = self.teacher(
                input_ids=to_input_device(self.teacher, batch), use_cache=False, output_hidden_states=with_hidden
            )
        student_out = student(input_ids=batch, use_cache=False, output_hidden_states=with_hidden)
        device = student_out.logits.device
        kl = distill_loss(student_out.logits, teacher_out.logits.to(device), self.config.temperature)
        loss, hidden = kl, None
        if with_hidden:
            teacher_hidden = [h.to(device) for h in teacher_out.hidden_states[1:]]
            student_hidden = [h.to(device) for h in student_out.hidden_states[1:]]
            hidden = hidden_mse(student_hidden, teacher_hidden)
            loss = kl + self.config.hidden_weight * hidden
        self._record(student.training, float(kl.detach()), None if hidden is None else float(hidden.detach()))
        return loss

    def _record(self, training: bool, kl: float, hidden: float | None) -> None:
        if training:
            self.kls.append(kl)
            if hidden is not None:
                self.hiddens.append(hidden)
        else:
            self.kl_after, self.hidden_after = kl, hidden

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kl_first": self.kls[0] if self.kls else None,
            "kl_last": self.kls[-1] if self.kls else None,
            "kls": list(self.kls),
            "kl_after": self.kl_after,
            "temperature": self.config.temperature,
            "hidden_weight": self.config.hidden_weight,
        }
        if self.config.hidden_weight > 0:
            out.update(
                hidden_first=self.hiddens[0] if self.hiddens else None,
                hidden_last=self.hiddens[-1] if self.hiddens else None,
                hiddens=list(self.hiddens),
                hidden_after=self.hidden_after,
            )
        return out


def distill_recover(
    model: nn.Module,
    teacher: nn.Module,
    tokenizer,
    config: LoraConfig,
    distill: DistillConfig,
    progress: Callable[[int], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train LoRA adapters on ``model`` to match ``teacher`` (module docstring), merge them; ``(model, report)``.

    ``model`` is modified in place as by :func:`~slimkit.primitives.finetune.lora.lora_recover`; ``teacher`` is
    only read (eval mode, no gradients). A diverged run raises ``SlimkitError("distill training diverged ...")``
    and leaves ``model`` as it was.
    """
    teacher.eval()
    teacher.requires_grad_(False)
    objective = DistillObjective(teacher, distill)
    training = train_lora(model, tokenizer, config, progress, loss_fn=objective, what="distill training")
    merged = merge_lora(training)
    return merged, {**training.report, **objective.report()}
