"""What a removed sub-block leaves in a decoder layer: a stand-in with no parameters that adds nothing.

A pre-norm decoder layer computes ``h = h + attn(norm1(h))`` then ``h = h + mlp(norm2(h))``. Removing a whole
attention (or MLP) block (ShortGPT, BlockPruner) means that branch contributes nothing to the residual stream, which
is the same as skipping it. Hugging Face's layer forward is kept as it is (slimkit copies no forward pass): the block
module is replaced by a stand-in returning zeros of the input's shape, and the block's norm by ``nn.Identity`` (its
weight is gone with the block). ``h + 0`` is ``h`` exactly, so outputs equal skipping the block bit for bit.

Zero heads inside Hugging Face's attention would not run (its ``view(..., -1, head_dim)`` of an empty tensor is
ambiguous), hence the stand-in. :class:`RemovedAttention` still records each token in the KV cache, as one value per
token (``[batch, 1, tokens, 1]`` ones, a few bytes): transformers reads the cached length from the first layer's
cache entry (``get_seq_length()``, generation's positions, the causal mask sizes), so a layer whose attention is
gone must keep its entry's length right or generation after it would restart positions at 0. The other layers'
entries are untouched.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

BlockKind = Literal["attention", "mlp"]
BLOCK_KINDS: tuple[BlockKind, ...] = ("attention", "mlp")


class RemovedAttention(nn.Module):
    """A removed attention block: returns ``(zeros, None)`` and keeps the KV cache's length (see the module doc)."""

    def __init__(self, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        """The head width the layer had (per-layer widths and GGUF's key length read it)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        cache = kwargs.get("past_key_values")
        if cache is not None:
            batch, tokens = hidden_states.shape[:2]
            marker = hidden_states.new_ones(batch, 1, tokens, 1)
            cache.update(marker, marker, self.layer_idx)
        return torch.zeros_like(hidden_states), None

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, head_dim={self.head_dim}"


class RemovedMLP(nn.Module):
    """A removed MLP block: returns zeros of its input's shape."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


__all__ = ["BLOCK_KINDS", "BlockKind", "RemovedAttention", "RemovedMLP"]
