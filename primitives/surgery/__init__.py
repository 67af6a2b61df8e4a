"""Physical removal of structure: the units of coupling groups (see :mod:`.units`)."""

from __future__ import annotations

import torch
from torch import nn

from slimkit.primitives.groups import layer_group
from slimkit.primitives.surgery.units import REMOVABLE_KINDS, SurgeryError, remove_units, sync_config


def prune_layer(model: nn.Module, kind: str, layer: int, keep: torch.Tensor) -> None:
    """Keep units ``keep`` of the ``kind`` group of ``layer`` (e.g. MLP channels, KV groups).

    The keep set is validated before anything changes (:func:`remove_units`); a refused one raises
    :class:`SurgeryError` and leaves the model as it was.
    """
    remove_units(model, layer_group(model, kind, layer), keep)


__all__ = ["REMOVABLE_KINDS", "SurgeryError", "prune_layer", "remove_units", "sync_config"]
