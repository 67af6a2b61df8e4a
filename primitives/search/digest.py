"""Content digests that key the search's caches: what a candidate, a score or a latency depends on.

A candidate of layer ``l`` is computed from layer ``l``'s weights and its dense inputs, which depend on every earlier
layer, the embeddings and the calibration tokens: :class:`RollingDigest` folds those in order (``prefix``, then one
layer at a time), so ``layer_key(l)`` changes whenever anything a candidate of layer ``l`` reads changes. A score
also depends on the later layers, the head and the held-out tokens: ``model_key`` covers the whole model. Every key
covers the model's config too (the same tensors under another architecture compute other outputs).
Tensors are hashed by name, dtype, shape and bytes (one tensor copied to the host at a time).

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

FORMAT = 2
"""Bumped when what a key covers, or how a cached entry is computed, changes."""


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes (host copy, contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def update_with_tensors(digest: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fold ``(name, tensor)`` pairs into ``digest`` (a hashlib object), one tensor at a time."""
    for name, tensor in named:
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor_bytes(tensor))


CONFIG_IGNORED = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})
"""Config entries that do not change what the model computes (the tensors' dtype is hashed with them)."""


def config_bytes(config: Any) -> bytes:
    """The model's config as canonical JSON, without :data:`CONFIG_IGNORED`: two models with the same tensors but
    another architecture or setting (RoPE, windows, norms) compute other outputs, so every key covers it."""
    values = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    kept = {key: value for key, value in values.items() if key not in CONFIG_IGNORED}
    return json.dumps(kept, sort_keys=True, default=str).encode()


def settings_key(settings: Any) -> str:
    """A short digest of JSON-able settings."""
    text = json.dumps({"format": FORMAT, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _unique(module: nn.Module, seen: set[int]) -> list[tuple[str, torch.Tensor]]:
    found = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor))
    return found


class RollingDigest:
    """The digest of everything up to one layer, then of the whole model (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], tokens: torch.Tensor) -> None:
        self._model = model
        self._layers = layers
        self._seen: set[int] = set()
        for layer in layers:  # the layers' own tensors are folded in one at a time, later
            self._seen.update(id(t) for t in [*layer.parameters(), *layer.buffers()])
        outside = [(n, t) for n, t in _unique(model, set()) if id(t) not in self._seen]
        self._digest = hashlib.sha256(f"format {FORMAT}".encode())
        self._digest.update(config_bytes(getattr(model, "config", None)))
        self._digest.update(tensor_bytes(tokens.to(torch.int64)))
        # everything outside the layers (embeddings, final norm, head): the embeddings feed every layer
        update_with_tensors(self._digest, outside)
        self._done = 0
        self._keys: list[str] = []
        self._pending: tuple[int, str] | None = None

    def _fold(self) -> None:
        update_with_tensors(self._digest, _unique(self._layers[self._done], set()))
        self._keys.append(self._digest.hexdigest()[:32])
        self._done += 1
        self._pending = None

    def layer_key(self, index: int) -> str:
        """The digest of the calibration tokens, the non-layer tensors and layers ``0..index``: the layers before
        ``index`` as they were when first folded in (in order), layer ``index`` as it is at the first call (so a
        layer-by-layer pass that changes each layer after asking for its key keys each layer by the changed ones
        before it)."""
        if index < self._done:
            return self._keys[index]
        while self._done < index:
            self._fold()
        if self._pending is None:
            digest = self._digest.copy()
            update_with_tensors(digest, _unique(self._layers[index], set()))
            self._pending = (index, digest.hexdigest()[:32])
        return self._pending[1]

    def model_key(self) -> str:
        """The digest of the calibration tokens and every tensor of the model (its layers as first folded in)."""
        while self._done < len(self._layers):
            self._fold()
        return self._keys[-1]


__all__ = ["FORMAT", "RollingDigest", "settings_key", "tensor_bytes", "update_with_tensors"]
