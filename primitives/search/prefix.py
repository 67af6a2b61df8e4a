"""Scoring a candidate of layer ``l`` without running layers ``0..l-1`` again: their dense outputs are known.

A candidate changes one layer; everything before it computes what the dense model computes. While
:func:`cached_prefix` is active, layers ``0..start-1`` are stand-ins that hand on the dense hidden states entering
layer ``start`` (recorded once per held-out batch, :func:`record_layer_inputs`), one batch per forward in order, so
a forward of
the whole model (its embeddings, the real layers ``start..L-1``, the final norm, the head, whatever each architecture
does around them) costs only the layers from ``start``: :func:`~slimkit.primitives.allocate.fitness.mean_kl` runs
unchanged. The decoder loop of transformers passes each layer's output to the next (``hidden_states =
layer(hidden_states, ...)``); the stand-ins rely on that and on nothing else (no forward is copied).

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.device.moves import to_input_device


class _HandOn(nn.Module):
    """A skipped layer: the last one returns the next recorded batch of hidden states, the others their input."""

    def __init__(self, queue: list[torch.Tensor] | None, layer: nn.Module) -> None:
        super().__init__()
        # the plain attributes a decoder loop may read off its layers (a hybrid's block or attention type)
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool)) and name != "training":
                setattr(self, name, value)
        self.queue = queue
        self.position = 0

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.queue is None:
            return hidden_states
        recorded = self.queue[self.position % len(self.queue)]
        self.position += 1
        if recorded.shape != hidden_states.shape:
            raise RuntimeError(f"recorded hidden states {tuple(recorded.shape)} != {tuple(hidden_states.shape)}")
        return recorded


@contextmanager
def cached_prefix(model: nn.Module, start: int, hidden: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside: forwards of ``model`` skip layers ``0..start-1``, layer ``start`` reading ``hidden[i]`` on the ``i``-th
    forward (cycling); ``start == 0`` changes nothing."""
    if start == 0:
        yield
        return
    layers = ModelView(model).layer_list
    originals = [layers[i] for i in range(start)]
    for i in range(start):
        layers[i] = _HandOn(list(hidden) if i == start - 1 else None, originals[i])
    try:
        yield
    finally:
        for i, module in enumerate(originals):
            layers[i] = module


def record_layer_inputs(model: nn.Module, batches: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The hidden states entering every layer on each batch, ``[layer][batch]``, from forwards of the whole model (so
    each layer saw exactly the masks and position embeddings the model gives it)."""
    layers = ModelView(model).layer_list
    recorded: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(index: int) -> Callable[[nn.Module, tuple, dict], None]:
        def keep(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            recorded[index].append(hidden.detach())

        return keep

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for batch in batches:
                model(to_input_device(model, batch), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return recorded


__all__ = ["cached_prefix", "record_layer_inputs"]
