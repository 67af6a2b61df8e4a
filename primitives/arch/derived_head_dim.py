"""Rebuilding attentions whose constructors derive the head width from the config (OPT, BERT).

Such a constructor sets ``head_dim = hidden_size // num_attention_heads`` and refuses a count that does not divide
the hidden size, so a saved config holding pruned head counts builds no model, or heads of another width. The loader
builds these models from a head count that divides (:func:`build_values`), materialises the saved shapes, then gives
each layer its saved head width (:func:`set_saved_head_dims`) before the head counts are synced from the shapes.

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from slimkit.primitives.arch.spec import ArchSpec
from slimkit.primitives.arch.view import ModelView
from slimkit.primitives.errors import SlimkitError

HEADS_KEY = "num_attention_heads"
"""The config and ``per_layer_config`` key of the query head count."""
HEAD_DIM_KEY = "head_dim"
"""The ``per_layer_config`` key of a layer's head width."""


def saved_head_dims(spec: ArchSpec, per_layer: Mapping[str, Mapping[str, Any]], where: str) -> dict[int, int]:
    """Each layer's saved head width (layers with attention), checked: one line naming ``where`` when a layer of a
    ``head_dim_from_hidden`` architecture lacks a positive integer ``head_dim``."""
    found = {}
    for index, widths in per_layer.items():
        if not str(index).isdigit() or widths.get(HEADS_KEY) == 0:
            continue  # a key the loader refuses by itself, or a layer whose attention block was removed
        head_dim = widths.get(HEAD_DIM_KEY)
        if type(head_dim) is not int or head_dim < 1:
            raise SlimkitError(
                f"{where}: per_layer_config layer {index} needs head_dim as a positive integer, got {head_dim!r} "
                f"({spec.model_type} derives the head width from the config, so the saved one must be given)"
            )
        found[int(index)] = head_dim
    return found


def build_values(spec: ArchSpec, config: Mapping[str, Any], head_dims: Mapping[int, int]) -> dict[str, int]:
    """The config values to build ``spec``'s model from in place of the saved ones (empty when the saved ones build
    heads of every saved width): one head (it divides any hidden size) when the saved count does not divide the
    hidden size or derives another width. The built widths are replaced by :func:`set_saved_head_dims`."""
    hidden, heads = config.get("hidden_size"), config.get(HEADS_KEY)
    if not spec.head_dim_from_hidden or type(hidden) is not int or type(heads) is not int:
        return {}  # a config without the two widths: transformers' own error names it
    if heads > 0 and hidden % heads == 0 and all(width == hidden // heads for width in head_dims.values()):
        return {}
    return {HEADS_KEY: 1}


def set_saved_head_dims(model: nn.Module, head_dims: Mapping[int, int]) -> None:
    """Give each layer of a freshly built ``model`` its saved head width (:meth:`LayerView.set_head_dim`); nothing
    for an architecture whose attention reads the width from the config."""
    view = ModelView(model)
    if not view.spec.head_dim_from_hidden:
        return
    for index, head_dim in head_dims.items():
        view.layer(index).set_head_dim(head_dim)


__all__ = ["HEADS_KEY", "HEAD_DIM_KEY", "build_values", "saved_head_dims", "set_saved_head_dims"]
