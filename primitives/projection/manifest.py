"""Manifest records for what hidden-dimension projection adds, and re-creating it on load.

Two kinds of entries in the manifest's ``modules`` list (next to LoRAP's ``low_rank``):

* ``basis_change``: a residual / basis-change matrix ``{"path": "<host>.basis_change", "kind",
  "in_features", "out_features", "bias", "hook": "input"|"output"}`` (see :mod:`.adapters`);
* ``rms_norm``: a ``torch.nn.RMSNorm`` that replaced a LayerNorm (:func:`~.norms.layernorm_to_rmsnorm`):
  ``{"path", "kind": "rms_norm", "width", "eps"}``. A model built from its HF config has a LayerNorm
  there, which the loader swaps before loading weights.

Per-layer hidden widths are not recorded here: they follow from the weights' shapes, and
``slimkit.save`` writes them into ``per_layer_config`` when they differ between layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from slimkit.primitives.projection.adapters import basis_change_entries, materialise_basis_changes

RMS_NORM_KIND = "rms_norm"


def rms_norm_entries(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"path": name, "kind": RMS_NORM_KIND, "width": int(m.weight.shape[0]), "eps": m.eps}
        for name, m in model.named_modules()
        if isinstance(m, nn.RMSNorm)
    ]


def projection_entries(model: nn.Module) -> list[dict[str, Any]]:
    """Manifest records of converted norms and basis changes, in module order."""
    return rms_norm_entries(model) + basis_change_entries(model)


def materialise_rms_norms(model: nn.Module, entries: Iterable[dict[str, Any]]) -> int:
    """Put an ``nn.RMSNorm`` of the recorded width at each ``rms_norm`` entry's path (before loading)."""
    count = 0
    for entry in entries:
        if entry.get("kind") != RMS_NORM_KIND:
            continue
        old = model.get_submodule(entry["path"])
        reference = next(iter(old.parameters()), None)
        new = nn.RMSNorm(int(entry["width"]), eps=entry.get("eps"), elementwise_affine=True)
        if reference is not None:
            new = new.to(device=reference.device, dtype=reference.dtype)
        parent_path, _, name = entry["path"].rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, new)
        count += 1
    return count


__all__ = [
    "RMS_NORM_KIND",
    "materialise_basis_changes",
    "materialise_rms_norms",
    "projection_entries",
    "rms_norm_entries",
]
