"""The recovery loop budgeted in tokens: packed streamed batches, a held-out validation loss, checkpoints to resume
from, data parallelism across processes (the trained tensors replicated, or the model sharded over them), and a
divergence that stops the run with the last good weights kept.

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.checkpoint import (
    SHARDED_KEY,
    load_checkpoint,
    load_sharded,
    random_state,
    restore_random_state,
    resume_problem,
    save_checkpoint,
    save_sharded_checkpoint,
    shapes_of,
)
from slimkit.primitives.finetune.distill import distill_loss, hidden_mse
from slimkit.primitives.finetune.loop import non_finite_problem
from slimkit.primitives.finetune.process_group import world
from slimkit.primitives.finetune.sharding import full_norm, load_sharded_state, local, sharded_state
from slimkit.primitives.finetune.token_stream import TextSource, TokenBudget, budget_batches, validation_windows

Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class RecoveryConfig:
    """A token-budgeted recovery run's settings (the adapters' are :class:`~slimkit.primitives.finetune.LoraConfig`)."""

    tokens: int
    batch_size: int = 4
    seq_len: int = 128
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    micro_batch_size: int | None = None  # None: a process's whole share of the batch at once
    autocast: bool = False  # forward passes under bfloat16 autocast (for a float32 model)
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    validation_windows: int = 8
    validate_every: int = 0  # 0: validation at the start and the end only
    checkpoint_every: int = 0  # 0: a checkpoint only when the run is stopped
    seed: int = 0

    @property
    def budget(self) -> TokenBudget:
        return TokenBudget(self.tokens, self.batch_size, self.seq_len)


class TokenObjective(Protocol):
    """A loss as a sum over counted tokens, so that split batches add up to the whole batch's mean."""

    def loss_sum(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...

    def count(self, mask: torch.Tensor) -> int: ...


class LanguageModelObjective:
    """The causal-LM loss: position ``t`` predicts token ``t + 1``, counted where token ``t + 1`` counts."""

    def count(self, mask: torch.Tensor) -> int:
        return int(mask[:, 1:].sum())

    def loss_sum(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        weight = mask[:, 1:].to(logits.device, torch.float32)
        targets = ids[:, 1:].to(logits.device)
        per_token = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
        return (per_token * weight).sum()


@dataclass
class DistillationObjective:
    """KL(teacher || student) per counted token at ``temperature`` (times its square), plus ``hidden_weight`` times
    the normalised hidden-state error of the micro-batch (that term is a ratio per micro-batch, so with it a split
    batch is close to, not equal to, the whole batch)."""

    teacher: nn.Module
    temperature: float = 1.0
    hidden_weight: float = 0.0

    def count(self, mask: torch.Tensor) -> int:
        return int(mask.sum())

    def loss_sum(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_weight > 0
        with torch.no_grad():
            teacher_out = self.teacher(
                input_ids=to_input_device(self.teacher, ids), use_cache=False, output_hidden_states=hidden
            )
        student_out = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
        device = student_out.logits.device
        counted = mask.to(device)
        loss = distill_loss(student_out.logits, teacher_out.logits.to(device), self.temperature, counted)
        if hidden:
            student_states = [h.to(device) for h in student_out.hidden_states[1:]]
            teacher_states = [h.to(device) for h in teacher_out.hidden_states[1:]]
            loss = loss + self.hidden_weight * hidden_mse(student_states, teacher_states, counted)
        return loss * counted.sum()


@dataclass
class RecoveryResult:
    """What a recovery run did: the curves, the tokens, where it stopped."""

    steps_done: int
    tokens: int
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean loss of the step's global batch), 1-based steps."""
    validation_curve: list[tuple[int, float]] = field(default_factory=list)
    """(steps done, mean validation loss); step 0 is before training."""
    tokens_curve: list[int] = field(default_factory=list)
    """Tokens trained after each step."""
    stopped: str | None = None
    """Why the run stopped before its budget (a divergence), None when it trained the whole budget."""
    resumed_from: int | None = None
    seconds: float = 0.0

    def report(self) -> dict[str, Any]:
        train = [loss for _step, loss in self.train_curve]
        return {
            "steps": self.steps_done,
            "tokens": self.tokens,
            "loss_first": train[0] if train else None,
            "loss_last": train[-1] if train else None,
            "losses": train,
            "validation": [{"step": s, "loss": v} for s, v in self.validation_curve],
            "validation_last": self.validation_curve[-1][1] if self.validation_curve else None,
            "tokens_curve": list(self.tokens_curve),
            "stopped": self.stopped,
            "resumed_from_step": self.resumed_from,
            "train_seconds": self.seconds,
        }


Progress = Callable[[int, int, "RecoveryResult"], None]
"""``progress(step, tokens_this_step, result)`` after each step."""


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


def _learning_rate_factor(config: RecoveryConfig) -> Callable[[int], float]:
    steps = config.budget.steps

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


MicroBatch = tuple[torch.Tensor, torch.Tensor, bool]
"""``(ids, mask, counted)``: a micro-batch's windows, its counted-token mask, and whether it counts (a padding
micro-batch of a sharded model runs with weight 0 so that every process joins the same collectives)."""


def _share(ids: torch.Tensor, mask: torch.Tensor, micro: int | None, pad: bool = False) -> list[MicroBatch]:
    """This process's windows of the global batch, in micro-batches. With ``pad`` every process gets the same
    number of micro-batches (those past its share: a copy of the batch's first window, not counted)."""
    rank, size = world()
    mine, mine_mask = ids[rank::size], mask[rank::size]
    step = micro or max(1, mine.shape[0])
    parts = [(mine[i : i + step], mine_mask[i : i + step], True) for i in range(0, mine.shape[0], step)]
    if pad and ids.shape[0]:
        most = -(-ids.shape[0] // size)  # the largest share
        wanted = -(-most // (micro or most))
        filler = (ids[:1], torch.ones_like(mask[:1]), False)
        parts += [filler] * (wanted - len(parts))
    return parts


def autocast_of(model: nn.Module, enabled: bool) -> torch.autocast:
    """bfloat16 autocast on ``model``'s device type (a no-op context when not ``enabled``)."""
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=enabled)


def mean_loss(
    model: nn.Module,
    objective: TokenObjective,
    ids: torch.Tensor,
    micro: int | None,
    autocast: bool = False,
    sharded: bool = False,
) -> float:
    """The objective's mean over the counted tokens of ``ids`` (all counted), shared out among the processes
    (``sharded``: the model's forward is collective, so every process runs as many micro-batches)."""
    mask = torch.ones_like(ids, dtype=torch.bool)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for part_ids, part_mask, counted in _share(ids, mask, micro, pad=sharded):
            with autocast_of(model, autocast):
                value = objective.loss_sum(model, to_input_device(model, part_ids), part_mask)
            if counted:
                total += torch.tensor([float(value), objective.count(part_mask)], dtype=torch.float64)
    _all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1]) if total[1] > 0 else math.nan


class RecoveryRun:
    """One token-budgeted run over ``trained`` (name -> the tensors the optimizer updates) of ``model``. ``sharded``:
    ``model`` is sharded over the processes (:mod:`~slimkit.primitives.finetune.sharding`), which reduces the
    gradients itself, and its checkpoints hold each process's shards of the weights and optimizer state."""

    def __init__(
        self,
        model: nn.Module,
        trained: dict[str, torch.Tensor],
        objective: TokenObjective,
        tokenizer,
        source: TextSource,
        config: RecoveryConfig,
        checkpoint: Path | None = None,
        sharded: bool = False,
    ) -> None:
        self.model, self.trained, self.objective, self.sharded = model, trained, objective, sharded
        self.tokenizer, self.source, self.config, self.checkpoint = tokenizer, source, config, checkpoint
        self.params = list(trained.values())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _learning_rate_factor(config))
        self.validation = validation_windows(tokenizer, source, config.seq_len, config.validation_windows)
        self.result = RecoveryResult(steps_done=0, tokens=0)
        self.last_good: list[torch.Tensor] | None = None
        self.last_good_step = 0

    # -- checkpoints -----------------------------------------------------------------------------------------
    def _progress(self) -> dict[str, Any]:
        """What a checkpoint holds besides the trained tensors and the optimizer's state."""
        r = self.result
        return {
            "step": r.steps_done,
            "tokens": r.tokens,
            "scheduler": self.scheduler.state_dict(),
            "random": random_state(),
            "train_curve": [list(p) for p in r.train_curve],
            "validation_curve": [list(p) for p in r.validation_curve],
            "tokens_curve": list(r.tokens_curve),
            "seconds": r.seconds,
        }

    def save(self) -> None:
        """Write the checkpoint: replicated, the main process writes it and every process waits; sharded, every
        process writes its own shards and the main process the rest."""
        if self.checkpoint is None:
            return
        rank, size = world()
        if self.sharded:
            shards = sharded_state(self.model, self.optimizer)
            state = {**self._progress(), SHARDED_KEY: shapes_of(shards["model"])} if rank == 0 else None
            save_sharded_checkpoint(self.checkpoint, state, shards)
            return
        if rank == 0:
            trained = {name: t.detach().to("cpu", copy=True) for name, t in self.trained.items()}
            state = {**self._progress(), "trained": trained, "optimizer": self.optimizer.state_dict()}
            save_checkpoint(self.checkpoint, state)
        if size > 1:
            import torch.distributed as dist

            dist.barrier()

    def resume(self) -> bool:
        """Load the checkpoint when there is one (every process reads it); whether the run resumed."""
        state = load_checkpoint(self.checkpoint) if self.checkpoint is not None else None
        if state is None or self.checkpoint is None:
            return False
        if self.sharded:
            shards = sharded_state(self.model, self.optimizer)
            problem = resume_problem(self.checkpoint, state, shapes_of(shards["model"]), sharded=True)
            if problem is not None:
                raise SlimkitError(problem)
            load_sharded(self.checkpoint, shards)
            load_sharded_state(self.model, self.optimizer, shards)
        else:
            problem = resume_problem(self.checkpoint, state, shapes_of(self.trained), sharded=False)
            if problem is not None:
                raise SlimkitError(problem)
            with torch.no_grad():
                for name, tensor in self.trained.items():
                    tensor.copy_(state["trained"][name])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_random_state(state["random"])
        r = self.result
        r.steps_done, r.tokens, r.seconds = int(state["step"]), int(state["tokens"]), float(state["seconds"])
        r.train_curve = [(int(s), float(v)) for s, v in state["train_curve"]]
        r.validation_curve = [(int(s), float(v)) for s, v in state["validation_curve"]]
        r.tokens_curve = [int(t) for t in state["tokens_curve"]]
        r.resumed_from = r.steps_done
        return True

    # -- the loop ------------------------------------------------------------------------------------------------
    def validate(self) -> float:
        config = self.config
        value = mean_loss(
            self.model, self.objective, self.validation, config.micro_batch_size, config.autocast, self.sharded
        )
        self.result.validation_curve.append((self.result.steps_done, value))
        return value

    def _step(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        """One global batch: the gradients of its mean loss; ``(mean loss, gradient norm)`` (not yet stepped)."""
        self.optimizer.zero_grad(set_to_none=True)
        count = self.objective.count(mask)
        total = torch.zeros(1, dtype=torch.float64)
        for part_ids, part_mask, counted in _share(ids, mask, self.config.micro_batch_size, pad=self.sharded):
            with autocast_of(self.model, self.config.autocast):
                loss = self.objective.loss_sum(self.model, to_input_device(self.model, part_ids), part_mask) / count
            if not counted:  # a sharded model's padding: joins the collectives, adds nothing
                loss = loss * 0.0
            else:
                total += float(loss.detach())
            if self.sharded or math.isfinite(float(loss.detach())):  # every process joins a sharded backward
                loss.backward()
        _all_reduce(total)
        if world()[1] > 1 and not self.sharded:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _all_reduce(p.grad)
        grads = [p for p in self.params if p.grad is not None]
        limit = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = float(full_norm(torch.nn.utils.clip_grad_norm_(grads, limit))) if grads else 0.0
        return float(total), norm

    def _stop(self, step: int, problem: str) -> None:
        """Divergence at (1-based) ``step``: the last weights that gave a finite loss back, and why it stopped."""
        if self.last_good is not None:
            with torch.no_grad():
                for tensor, good in zip(self.params, self.last_good, strict=True):
                    tensor.copy_(good)
        self.result.stopped = (
            f"diverged at step {step}: {problem}; kept the weights after step {self.last_good_step} "
            f"(lower learning_rate, got {self.config.learning_rate:g})"
        )

    def run(self, progress: Progress | None = None) -> RecoveryResult:
        config, r = self.config, self.result
        budget = config.budget
        started = time.perf_counter() - (r.seconds if self.resume() else 0.0)
        self.model.train()
        if not r.validation_curve and config.validation_windows:
            self.validate()
        for step, ids, mask in budget_batches(
            self.tokenizer, self.source, budget, config.validation_windows, r.steps_done
        ):
            loss, norm = self._step(ids, mask)
            if not math.isfinite(loss) or not math.isfinite(norm):
                what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {norm}"
                self._stop(step + 1, what)
                break
            self.last_good = [p.detach().clone() for p in self.params]
            self.last_good_step = step
            self.optimizer.step()
            self.scheduler.step()
            trained = int(mask.sum())
            r.steps_done, r.tokens = step + 1, r.tokens + trained
            r.train_curve.append((step + 1, loss))
            r.tokens_curve.append(r.tokens)
            r.seconds = time.perf_counter() - started
            last = step + 1 == budget.steps
            if config.validate_every and (step + 1) % config.validate_every == 0 and not last:
                self.validate()
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 and not last:
                self.save()
            if progress is not None:
                progress(step + 1, trained, r)
        self.optimizer.zero_grad(set_to_none=True)
        self._check_final()
        self.model.eval()
        r.seconds = time.perf_counter() - started
        if r.stopped is None:  # a run killed after this point (saving, evaluating) skips the training when rerun
            self.save()
        return r

    def _check_final(self) -> None:
        """The last update is checked on what it made: the validation loss (or NaN/inf in the trained tensors)."""
        r = self.result
        if r.stopped is not None or r.steps_done == 0:
            return
        if self.config.validation_windows:
            if r.validation_curve and r.validation_curve[-1][0] == r.steps_done:
                value = r.validation_curve[-1][1]
            else:
                value = self.validate()
            if not math.isfinite(value):
                self._stop(r.steps_done, f"validation loss {value} after the update")
                r.validation_curve[-1] = (r.validation_curve[-1][0], value)
            return
        problem = non_finite_problem(((n, local(t)) for n, t in self.trained.items()), "trained tensors")
        if self.sharded:  # each process sees its shards: the verdict is shared
            flag = _all_reduce(torch.tensor([1.0 if problem else 0.0]))
            problem = problem or ("trained tensors hold NaN/inf on another process" if float(flag) else None)
        if problem:
            self._stop(r.steps_done, problem)


__all__ = [
    "DistillationObjective",
    "LanguageModelObjective",
    "RecoveryConfig",
    "RecoveryResult",
    "RecoveryRun",
    "TokenObjective",
    "mean_loss",
]
