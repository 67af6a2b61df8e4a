"""Removing coupled structures from one layer through its :class:`LayerView`.

* MLP channel ``i``: row ``i`` of up (and gate), column ``i`` of down.
* Attention heads: kept KV groups (a KV head with the query heads that share it under grouped-query
  attention) - rows of q/k/v and columns of o. Without GQA a KV group is a single head.
Head counts on the attention module are re-synced from the new shapes.
"""

from __future__ import annotations

import torch
from slimkit.primitives.arch import LayerView
from slimkit.primitives.surgery.linear import slice_linear


def _sorted_long(index: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(index, dtype=torch.long).sort().values


def prune_mlp_channels(layer: LayerView, keep: torch.Tensor) -> None:
    """Keep MLP channels ``keep`` (indices into the intermediate dimension) of ``layer``."""
    keep = _sorted_long(keep)
    for role in layer.mlp_input_roles:
        layer.set_linear(role, slice_linear(layer.linear(role), keep_out=keep))
    layer.set_linear("down", slice_linear(layer.linear("down"), keep_in=keep))


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


def prune_attention_heads(layer: LayerView, keep_kv_groups: torch.Tensor) -> None:
    """Keep the KV groups ``keep_kv_groups`` (each a KV head and its query heads)."""
    keep_kv = _sorted_long(keep_kv_groups)
    d, group = layer.head_dim, layer.num_heads // layer.num_kv_heads
    keep_q = (keep_kv[:, None] * group + torch.arange(group)[None, :]).reshape(-1)
    rows_q, rows_kv = _head_rows(keep_q, d), _head_rows(keep_kv, d)
    layer.set_linear("q", slice_linear(layer.linear("q"), keep_out=rows_q))
    layer.set_linear("k", slice_linear(layer.linear("k"), keep_out=rows_kv))
    layer.set_linear("v", slice_linear(layer.linear("v"), keep_out=rows_kv))
    layer.set_linear("o", slice_linear(layer.linear("o"), keep_in=rows_q))
    layer.sync_head_counts()
