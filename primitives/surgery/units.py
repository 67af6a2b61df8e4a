"""Physically removing units of a :class:`Group` from a model.

Every member parameter is sliced along its dimension (positions of removed units dropped), each
distinct parameter once; module attributes that mirror shapes are updated (Linear
``in_features``/``out_features``, Embedding ``embedding_dim``, LayerNorm ``normalized_shape``);
attention head attributes are re-synced from the new projection shapes; a head that was tied to the
embeddings is tied again; and the config's width fields follow when every layer agrees and the
config class accepts the values (per-layer widths are otherwise recorded at save time).
"""

from __future__ import annotations

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.groups import Group
from slimkit.primitives.io.save import config_accepts

REMOVABLE_KINDS = ("mlp_channel", "attention_head", "kv_group", "hidden_feature")


def _kept_positions(length: int, removed: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(length, dtype=torch.bool)
    mask[removed] = False
    return mask.nonzero().flatten()


def _sync_module_attributes(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = module.weight.shape
    elif isinstance(module, nn.LayerNorm):
        module.normalized_shape = (module.weight.shape[0],)


def sync_config(model: nn.Module) -> None:
    """Write uniform per-layer widths (and the hidden size) into the config when it accepts them."""
    view = ModelView(model)
    widths = view.layer_widths()
    if any(w != widths[0] for w in widths):
        return
    values = {**widths[0], "hidden_size": view.hidden_size}
    if view.spec.model_type == "opt":
        values["word_embed_proj_dim"] = view.hidden_size
    candidate = {**model.config.to_dict(), **values}
    for key in ("model_type", "transformers_version"):
        candidate.pop(key, None)
    if config_accepts(type(model.config), candidate):
        for key, value in values.items():
            setattr(model.config, key, value)


def remove_units(model: nn.Module, group: Group, keep: torch.Tensor) -> None:
    """Keep units ``keep`` of ``group`` (indices into its units) and remove the rest."""
    if group.kind not in REMOVABLE_KINDS:
        raise ValueError(f"group kind '{group.kind}' cannot be removed from HF modules; removable: {REMOVABLE_KINDS}")
    view = ModelView(model)
    tied = view.tied
    removed_units = _kept_positions(group.size, torch.as_tensor(keep, dtype=torch.long))
    touched: dict[int, nn.Module] = {}
    done: set[tuple[int, int]] = set()
    for member in group.members:
        module = model.get_submodule(member.module)
        tensor = getattr(module, member.param)
        if (id(tensor), member.dim) in done:
            continue
        done.add((id(tensor), member.dim))
        removed = member.indices[removed_units].reshape(-1)
        positions = _kept_positions(tensor.shape[member.dim], removed)
        new = nn.Parameter(tensor.detach().index_select(member.dim, positions).clone(), tensor.requires_grad)
        setattr(module, member.param, new)
        touched[id(module)] = module
    for module in touched.values():
        _sync_module_attributes(module)
    if tied:
        view.head.weight = view.embed_tokens.weight
        _sync_module_attributes(view.head)
    for layer in view.layers:
        layer.sync_head_counts()
    sync_config(model)
