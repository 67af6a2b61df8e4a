"""Whole sub-blocks as units (ShortGPT, BlockPruner): a decoder layer's attention block or MLP block, removed so it
adds nothing to the residual stream (:mod:`.remove`), chosen by BlockPruner's iterative loss search (:mod:`.search`).

Method note: docs/methods/block-removal.md.
"""

from slimkit.primitives.blocks.remove import (
    Block,
    block_params,
    check_blocks,
    check_removable,
    kept_per_kind,
    present_blocks,
    remove_block,
    removed_blocks,
    restore_removed_blocks,
    without_block,
)
from slimkit.primitives.blocks.search import LayerLoss, SearchResult, SearchStep, search_blocks

__all__ = [
    "Block",
    "LayerLoss",
    "SearchResult",
    "SearchStep",
    "block_params",
    "check_blocks",
    "check_removable",
    "kept_per_kind",
    "present_blocks",
    "remove_block",
    "removed_blocks",
    "restore_removed_blocks",
    "search_blocks",
    "without_block",
]
