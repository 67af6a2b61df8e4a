"""Whole attention and MLP blocks of decoder layers as units: which exist, what each holds, removing them.

A :class:`Block` is one layer's attention block (its norm, q/k/v/o and any q/k norms) or MLP block (its norm and
gate/up/down). :func:`remove_block` puts the stand-ins of :mod:`slimkit.primitives.arch.removed` in their place, so
the block's parameters leave the model and its branch adds nothing to the residual stream (equal to skipping it);
:func:`without_block` does the same for the length of a ``with`` (the search tries every candidate this way, with no
weight copied). A saved model records a removed block as zero heads or zero MLP width in ``per_layer_config``;
:func:`restore_removed_blocks` removes the same blocks from a freshly built model before its weights load.

Method note: docs/methods/block-removal.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from slimkit.primitives.arch import (
    BLOCK_KINDS,
    BlockKind,
    LayerView,
    ModelView,
    RemovedAttention,
    RemovedMLP,
    removable_blocks,
)
from slimkit.primitives.arch.moe import MOE_SPECS
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import param_parts


@dataclass(frozen=True, order=True)
class Block:
    """One sub-block: ``layer``'s ``attention`` or ``mlp``."""

    layer: int
    kind: BlockKind

    def __str__(self) -> str:
        return f"{self.layer}.{self.kind}"


def check_removable(model: nn.Module) -> ModelView:
    """The model's view, or one line when its architecture has no removable sub-blocks."""
    view = ModelView(model)
    reason = removable_blocks(view.spec)
    if reason is not None:
        raise SlimkitError(f"whole attention / MLP blocks cannot be removed from this model: {reason}")
    return view


def _paths(layer: LayerView, kind: BlockKind) -> tuple[str, tuple[str, ...]]:
    """(the block module's path, its norms' paths: input norm and branch post-norm where it has them), relative to
    the layer. A branch post-norm of a removed block would normalise zeros to zeros; it goes with the block."""
    block = layer.spec.attention if kind == "attention" else str(layer.spec.mlp)
    return block, layer.spec.block_norms(kind)


def _stand_in(layer: LayerView, kind: BlockKind) -> nn.Module:
    if kind == "attention":
        return RemovedAttention(int(getattr(layer.attention, "layer_idx", layer.index)), layer.head_dim)
    return RemovedMLP()


def block_params(model: nn.Module, block: Block, part: str = "total") -> int:
    """Parameters the block holds (its module and its norm; tied ones once), counting only those of ``part``, an
    entry of :func:`~slimkit.primitives.evaluate.counting.params_by_part` (``total``, ``layers``, ``attention``,
    ``mlp``, ``norms``): what removing the block takes off that count."""
    layer = ModelView(model).layer(block.layer)
    block_path, norm_paths = _paths(layer, block.kind)
    params = {id(p): p for path in (block_path, *norm_paths) for p in layer.module.get_submodule(path).parameters()}
    if part == "total":
        return sum(p.numel() for p in params.values())
    parts = param_parts(model)
    return sum(p.numel() for key, p in params.items() if parts[key][0] == part or (part == "layers" and parts[key][1]))


def _swap(layer: LayerView, kind: BlockKind) -> tuple[nn.Module, list[nn.Module]]:
    """Put the stand-ins in place; returns the block and norm modules they replaced."""
    block_path, norm_paths = _paths(layer, kind)
    block = layer.module.get_submodule(block_path)
    norms = [layer.module.get_submodule(path) for path in norm_paths]
    layer.module.set_submodule(block_path, _stand_in(layer, kind))
    for path in norm_paths:
        layer.module.set_submodule(path, nn.Identity())
    return block, norms


def _check_present(view: ModelView, block: Block) -> LayerView:
    if block.kind not in BLOCK_KINDS:
        raise SlimkitError(f"block kind '{block.kind}' is not one of {', '.join(BLOCK_KINDS)}")
    if not 0 <= block.layer < view.num_layers:
        raise SlimkitError(f"block {block}: the model has layers 0-{view.num_layers - 1}")
    layer = view.layer(block.layer)
    if block.kind in layer.removed_blocks:
        raise SlimkitError(f"block {block} was already removed")
    return layer


def remove_block(model: nn.Module, block: Block) -> None:
    """Remove ``block`` from ``model`` for good (its parameters are freed with the modules)."""
    view = check_removable(model)
    _swap(_check_present(view, block), block.kind)


@contextmanager
def without_block(model: nn.Module, block: Block) -> Iterator[None]:
    """``model`` with ``block`` removed inside the ``with``, restored (the same modules) after it."""
    view = check_removable(model)
    layer = _check_present(view, block)
    module, norms = _swap(layer, block.kind)
    try:
        yield
    finally:
        block_path, norm_paths = _paths(layer, block.kind)
        layer.module.set_submodule(block_path, module)
        for path, norm in zip(norm_paths, norms, strict=True):
            layer.module.set_submodule(path, norm)


def removed_blocks(model: nn.Module) -> list[Block]:
    """The blocks already removed from ``model``, in layer order."""
    return [Block(layer.index, kind) for layer in ModelView(model).layers for kind in layer.removed_blocks]


def present_blocks(model: nn.Module, kinds: Iterable[BlockKind], layers: Iterable[int]) -> list[Block]:
    """The blocks of ``kinds`` in ``layers`` that are still in the model."""
    view = ModelView(model)
    wanted = tuple(kinds)
    return [Block(index, kind) for index in layers for kind in wanted if kind not in view.layer(index).removed_blocks]


def kept_per_kind(model: nn.Module) -> dict[BlockKind, int]:
    """How many blocks of each kind the model still has (all layers)."""
    view = ModelView(model)
    return {kind: sum(kind not in layer.removed_blocks for layer in view.layers) for kind in BLOCK_KINDS}


def check_blocks(model: nn.Module, blocks: Iterable[Block]) -> None:
    """One line unless removing ``blocks`` (each once, still present) leaves at least one block of each kind.

    A decoder with no attention block left reads no context; one with no MLP block left has no per-token
    transform: neither is a language model any more, so no plan may remove every block of a kind."""
    view = check_removable(model)
    chosen = list(blocks)
    if len(set(chosen)) != len(chosen):
        raise SlimkitError(f"blocks {', '.join(map(str, chosen))}: each block once")
    for block in chosen:
        _check_present(view, block)
    kept = kept_per_kind(model)
    for kind in BLOCK_KINDS:
        left = kept[kind] - sum(block.kind == kind for block in chosen)
        if left < 1:
            raise SlimkitError(
                f"removing {', '.join(str(b) for b in chosen if b.kind == kind)} would leave no {kind} block in the "
                f"model's {view.num_layers} layers; at least one must stay"
            )


def restore_removed_blocks(model: nn.Module, per_layer: Mapping[str, Mapping[str, Any]]) -> list[Block]:
    """Remove from a freshly built ``model`` the blocks a saved ``per_layer_config`` records as gone (zero query
    heads: the attention block; a zero MLP width: the MLP block); returns them."""
    view = ModelView(model)
    found: list[Block] = []
    moe = MOE_SPECS.get(view.spec.model_type)
    for index, widths in per_layer.items():
        mlp_key = view.spec.intermediate_size_key
        if moe is not None and moe.dense_width_key is not None and not moe.routes(model.config, int(index)):
            mlp_key = moe.dense_width_key  # a dense layer of a family that mixes dense and routed MLPs
        if widths.get("num_attention_heads") == 0:
            found.append(Block(int(index), "attention"))
        if widths.get(mlp_key) == 0:
            found.append(Block(int(index), "mlp"))
    if found:
        check_removable(model)
    for block in found:
        remove_block(model, block)
    return found


__all__ = [
    "Block",
    "block_params",
    "check_blocks",
    "check_removable",
    "kept_per_kind",
    "present_blocks",
    "remove_block",
    "removed_blocks",
    "restore_removed_blocks",
    "without_block",
]
