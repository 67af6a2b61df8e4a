"""Physical removal of structure: slicing Linear rows/columns, MLP channels, attention heads."""

from slimkit.primitives.surgery.linear import slice_linear
from slimkit.primitives.surgery.structures import prune_attention_heads, prune_mlp_channels

__all__ = ["prune_attention_heads", "prune_mlp_channels", "slice_linear"]
