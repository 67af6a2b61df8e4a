"""Gradients of the calibration loss, accumulated for the tensors a scorer reads.

Method note: docs/methods/scorers.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimkit.primitives.device.moves import math_dtype, to_input_device
from slimkit.primitives.errors import SlimkitError


@dataclass
class GradientStats:
    """Sums over calibration batches of the gradient (``grad``) and, if gathered, of its square (``grad_sq``)."""

    grad: dict[int, torch.Tensor]
    grad_sq: dict[int, torch.Tensor]
    batches: int

    def of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum of g, sum of g^2 or None when squares were not gathered)`` of ``tensor``, on ``tensor``'s device (sums
        kept on ``stats_device`` move over one tensor at a time, when a scorer reads them)."""
        key = id(tensor)
        if key not in self.grad:
            raise SlimkitError(
                f"no gradient statistics were gathered for a tensor of shape {tuple(tensor.shape)}; "
                "the stage asked for gradients of other tensors than its scorer reads"
            )
        squares = self.grad_sq.get(key)
        return self.grad[key].to(tensor.device), None if squares is None else squares.to(tensor.device)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.grad

    def nbytes(self) -> int:
        """Bytes the sums hold."""
        return sum(t.numel() * t.element_size() for d in (self.grad, self.grad_sq) for t in d.values())


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        found.setdefault(id(tensor), tensor)
    return list(found.values())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (through the architecture adapter)."""
    from slimkit.primitives.arch import ModelView

    return [layer.module for layer in ModelView(model).layers]


@contextlib.contextmanager
def checkpointed(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Recompute each layer's forward in the backward instead of keeping its activations (non-reentrant)."""
    originals = []
    try:
        for layer in layers:
            original = layer.forward
            originals.append((layer, original))
            layer.forward = functools.partial(checkpoint, original, use_reentrant=False)
        yield
    finally:
        for layer, _original in originals:
            del layer.forward  # the instance attribute; the class's forward shows again


def accumulate_gradients(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    progress: Callable[[int], None] | None = None,
    tensors: Sequence[torch.Tensor] | None = None,
    squares: bool = True,
    stats_device: str | torch.device | None = None,
    checkpoint_layers: bool = False,
) -> GradientStats:
    """Sums of the calibration-loss gradients of ``tensors`` (default: every parameter) over ``batches``.

    ``squares``: also sum g*g; ``stats_device``: where the float32 sums live (None: each parameter's device);
    ``checkpoint_layers``: recompute decoder layers in the backward (less activation memory).
    """
    params = list(model.parameters())
    wanted = _unique(params if tensors is None else tensors)
    known = {id(p) for p in params}
    if any(id(t) not in known for t in wanted):
        raise SlimkitError("accumulate_gradients: a requested tensor is not a parameter of the model")
    flags = [p.requires_grad for p in params]
    was_training = model.training
    where = {id(p): torch.device(stats_device) if stats_device is not None else p.device for p in wanted}
    grad = {id(p): torch.zeros(p.shape, dtype=math_dtype(p.dtype), device=where[id(p)]) for p in wanted}
    grad_sq = (
        {id(p): torch.zeros(p.shape, dtype=math_dtype(p.dtype), device=where[id(p)]) for p in wanted} if squares else {}
    )

    def fold(param: torch.Tensor) -> None:
        if param.grad is None:  # the hook runs after accumulation; nothing to fold without a gradient
            return
        key = id(param)
        g = param.grad.to(device=grad[key].device, dtype=grad[key].dtype)
        grad[key] += g
        if squares:
            grad_sq[key] += g * g  # as the full-buffer sums did (addcmul_ would round differently)
        param.grad = None  # freed now: the next parameter's gradient does not sit beside it

    wanted_ids = {id(p) for p in wanted}
    handles = []
    count = 0
    layers = decoder_layers(model) if checkpoint_layers else []
    try:
        model.eval()  # no dropout: the scores describe the model as it is used
        for p in params:
            p.requires_grad_(id(p) in wanted_ids)
        handles = [p.register_post_accumulate_grad_hook(fold) for p in wanted]
        with checkpointed(layers):
            for batch in batches:
                model.zero_grad(set_to_none=True)
                batch = to_input_device(model, batch)
                loss = model(batch, labels=batch, use_cache=False).loss
                loss.float().backward()
                del loss
                count += 1
                if progress is not None:
                    progress(1)
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
    return GradientStats(grad, grad_sq, count)
