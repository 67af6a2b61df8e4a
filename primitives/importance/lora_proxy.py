"""Per-batch weight gradients for scoring: the true gradient, or LoRAPrune's LoRA-gradient proxy.

Both yield one :class:`BatchGradients` per calibration batch, read like
:class:`~slimkit.primitives.calibration.gradients.GradientStats` by any gradient scorer (``taylor``, ``coupled``).

Method note: docs/methods/cce-coupled-scores.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from slimkit.primitives.calibration.gradients import checkpointed, decoder_layers
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError


@dataclass
class BatchGradients:
    """One batch's gradients by parameter identity; values are tensors or zero-argument estimators."""

    tensors: dict[int, torch.Tensor | Callable[[], torch.Tensor]]
    loss: float = float("nan")
    report: dict = field(default_factory=dict)

    def of(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gradient, its square)`` of ``weight`` on ``weight``'s device (a gradient kept on ``stats_device`` moves
        over when it is read)."""
        value = self.tensors[id(weight)]
        grad = (value() if callable(value) else value).to(weight.device)
        return grad, grad * grad

    def __contains__(self, weight: torch.Tensor) -> bool:
        return id(weight) in self.tensors


def loraprune_gradient(
    a: torch.Tensor, b: torch.Tensor, grad_a: torch.Tensor, grad_b: torch.Tensor, lr: float = 1.0
) -> torch.Tensor:
    """LoRAPrune Eq. 9: the gradient on the product B A (B [d_out, r], A [r, d_in]) from the factors."""
    return grad_b @ a + b @ grad_a - lr * (grad_b @ grad_a)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    batch = to_input_device(model, batch)
    loss = model(batch, labels=batch, use_cache=False).loss.float()
    if not math.isfinite(float(loss.detach())):
        raise SlimkitError(f"calibration loss is not finite ({float(loss.detach())}); the model is broken")
    return loss


class _Frozen:
    """Freeze every parameter except ``trainable`` (by identity); restore flags and mode on exit."""

    def __init__(self, model: nn.Module, trainable: set[int]) -> None:
        self.model, self.trainable = model, trainable

    def __enter__(self) -> None:
        self.flags = {id(p): (p, p.requires_grad) for p in self.model.parameters()}
        self.training = self.model.training
        self.model.eval()
        for p, _flag in self.flags.values():
            p.requires_grad_(id(p) in self.trainable)

    def __exit__(self, *_exc) -> None:
        self.model.zero_grad(set_to_none=True)
        for p, flag in self.flags.values():
            p.requires_grad_(flag)
        self.model.train(self.training)


def full_gradients(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    stats_device: str | torch.device | None = None,
    checkpoint_layers: bool = False,
) -> Iterator[BatchGradients]:
    """The true gradient of each batch's loss w.r.t. ``weights``; valid until the next batch is drawn.

    ``stats_device``: each gradient is moved there as soon as autograd has finished it (a post-accumulate
    hook), so the weights' device holds one gradient at a time; ``checkpoint_layers``: recompute decoder
    layers in the backward (see :mod:`slimkit.primitives.calibration.gradients`)."""
    state = sum(w.numel() * w.element_size() for w in weights)
    moved: dict[int, torch.Tensor] = {}

    def move(param: torch.Tensor) -> None:
        moved[id(param)] = param.grad.to(stats_device)
        param.grad = None

    handles = [w.register_post_accumulate_grad_hook(move) for w in weights] if stats_device is not None else []
    layers = decoder_layers(model) if checkpoint_layers else []
    try:
        with _Frozen(model, {id(w) for w in weights}), checkpointed(layers):
            for batch in batches:
                model.zero_grad(set_to_none=True)
                moved.clear()
                loss = _loss(model, batch)
                loss.backward()
                grads = dict(moved) if stats_device is not None else {}
                grads |= {id(w): w.grad for w in weights if w.grad is not None}
                yield BatchGradients(grads, float(loss.detach()), {"state_bytes": state})
                del grads
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class LoraProxyConfig:
    rank: int = 8
    alpha: float = 16.0
    steps: int = 5
    learning_rate: float = 1e-4
    seed: int = 0


def _owning_linears(model: nn.Module, weights: Sequence[torch.Tensor]) -> dict[str, nn.Linear]:
    wanted = {id(w) for w in weights}
    found = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in wanted}
    if len(found) != len(wanted):
        raise SlimkitError(
            f"LoRA gradients: {len(wanted) - len(found)} of the weights to score are not nn.Linear weights "
            "(low-rank pairs, embeddings or norms); use gradients: full"
        )
    return found


def lora_gradients(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    config: LoraProxyConfig,
) -> list[BatchGradients]:
    """LoRAPrune-style gradient estimates of ``weights`` (Linear weights), one :class:`BatchGradients` per batch."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    linears = _owning_linears(model, weights)
    flags = {id(p): (p, p.requires_grad) for p in model.parameters()}
    training = model.training
    peft_config = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=list(linears), bias="none"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, peft_config)
    factors: list[dict[int, tuple[torch.Tensor, ...]]] = []
    losses: list[float] = []
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    adapters = [(m.lora_A["default"].weight, m.lora_B["default"].weight, m.scaling["default"], m) for m in layers]
    params = [p for a, b, _s, _m in adapters for p in (a, b)]
    try:
        model.eval()
        if config.steps > 0:
            optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
            for step in range(config.steps):
                optimizer.zero_grad(set_to_none=True)
                _loss(model, batches[step % len(batches)]).backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        adapter_bytes = sum(p.numel() * p.element_size() for p in params) * (4 if config.steps > 0 else 2)
        for batch in batches:
            for p in params:
                p.grad = None
            loss = _loss(model, batch)
            loss.backward()
            losses.append(float(loss.detach()))
            per_batch = {}
            for a, b, scaling, layer in adapters:
                product_b = b.detach() * scaling  # peft adds scaling * B A; estimate on that product
                grad_b = b.grad / scaling if b.grad is not None else torch.zeros_like(b)
                grad_a = a.grad if a.grad is not None else torch.zeros_like(a)
                per_batch[id(layer.base_layer.weight)] = (a.detach().clone(), product_b.clone(), grad_a.clone(), grad_b)
            factors.append(per_batch)
    finally:
        for p in params:
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            peft_model.unload()
        for p, flag in flags.values():
            p.requires_grad_(flag)
        model.train(training)
    stored = sum(t.numel() * t.element_size() for f in factors for ts in f.values() for t in ts)
    report = {"state_bytes": adapter_bytes + stored, "trained_steps": config.steps}
    return [
        BatchGradients({key: partial(loraprune_gradient, *ts) for key, ts in per_batch.items()}, loss, report)
        for per_batch, loss in zip(factors, losses, strict=True)
    ]


__all__ = ["BatchGradients", "LoraProxyConfig", "full_gradients", "lora_gradients", "loraprune_gradient"]
