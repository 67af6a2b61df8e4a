"""Peak bytes of live tensors during a phase, counted exactly on any device (CPU included).

``with LiveTensorBytes() as live: ...`` counts every tensor storage that a torch operation creates
inside the block (forward, backward, optimiser steps: autograd's ops go through the same dispatcher),
from its creation until it is freed, and keeps the peak of their sum. Tensors that existed before the
block (the weights) are not counted, so ``peak`` is what the phase adds on top of the model. Unlike
RSS it is deterministic and blind to the allocator's caching and to the Python process itself, which
makes it the measure for tests that compare the memory of two code paths on tiny models.
Views share their base's storage and are counted once. Slow (a Python call per operation): for tests
and diagnostics, not for production runs.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storages created inside the block and still alive: ``now`` and the ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self.now -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self.now += nbytes
        self.peak = max(self.peak, self.now)

        def freed(_ref: weakref.ref, key: int = key, nbytes: int = nbytes) -> None:
            self._freed(key, nbytes)

        self._live[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out


__all__ = ["LiveTensorBytes"]
