"""The search's fitness: how far a candidate's next-token distribution is from the dense model's.

:func:`dense_log_probs` caches the dense model's log-probabilities on held-out token batches once (float32, on the
CPU: ``tokens x vocabulary x 4`` bytes, 201 MB for one batch of 8 x 128 tokens at SmolLM2's 49,152 words);
:func:`mean_kl` runs the model batch by batch and returns the KL divergence ``KL(dense || model)`` of the next-token
distributions averaged over every position, so only one batch of logits is alive at a time. A candidate allocation is
assembled without copying any weight: :func:`masked_units` zeroes the removed units' input columns of their
consumers (``down_proj`` for MLP channels, ``o_proj`` for heads) with forward pre-hooks, which is exactly the output
of removing them (without a refit).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.groups import Group


def _log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(to_input_device(model, batch), use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1)


def dense_log_probs(model: nn.Module, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The model's next-token log-probabilities ``[batch, seq, vocab]`` (float32, CPU) on each batch."""
    with torch.no_grad():
        return [_log_probs(model, batch).cpu() for batch in batches]


def mean_kl(model: nn.Module, batches: Sequence[torch.Tensor], dense: Sequence[torch.Tensor]) -> float:
    """``KL(dense || model)`` of the next-token distributions, averaged over every position of every batch."""
    total, positions = 0.0, 0
    with torch.no_grad():
        for batch, reference in zip(batches, dense, strict=True):
            log_probs = _log_probs(model, batch).cpu()
            kl = (reference.exp() * (reference - log_probs)).sum(-1)
            total += float(kl.sum())
            positions += kl.numel()
            del log_probs, kl
    return total / max(positions, 1)


def consumer_masks(model: nn.Module, groups: Sequence[Group], kept: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per consumer module path, a 0/1 vector over its inputs: 0 at the input columns of every removed unit."""
    masks: dict[str, torch.Tensor] = {}
    for group, keep in zip(groups, kept, strict=True):
        removed = torch.ones(group.size, dtype=torch.bool)
        removed[keep.long().cpu()] = False
        for member in group.members:
            if member.param != "weight" or member.dim != 1:
                continue
            width = member.tensor(model).shape[1]
            mask = masks.setdefault(member.module, torch.ones(width))
            mask[member.indices[removed].flatten().long().cpu()] = 0.0
    return masks


@contextmanager
def masked_units(model: nn.Module, groups: Sequence[Group], kept: Sequence[torch.Tensor]) -> Iterator[None]:
    """While inside, every group keeps only its ``kept`` units: the others' consumer input columns read zeros."""
    handles = []
    try:
        for path, mask in consumer_masks(model, groups, kept).items():
            module = model.get_submodule(path)
            weight = module.weight
            factor = mask.to(device=weight.device, dtype=weight.dtype)

            def hook(_module: nn.Module, args: tuple, factor: torch.Tensor = factor) -> tuple:
                return (args[0] * factor, *args[1:])

            handles.append(module.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["consumer_masks", "dense_log_probs", "masked_units", "mean_kl"]
