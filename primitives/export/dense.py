"""A compressed decoder as plain dense tensors: the form inference engines read.

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.fused import fuse_tensors
from slimkit.primitives.arch.layer_kinds import merged_widths
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.save import layer_hidden_size
from slimkit.primitives.lowrank.module import LowRankLinear
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE_NAME
from slimkit.primitives.projection.adapters import BasisChange


@dataclass
class DenseModel:
    """A decoder's weights as dense Hugging Face-named tensors, and what was merged to get them."""

    tensors: dict[str, torch.Tensor]
    tied: bool
    """The head reads the token embedding (no separate head tensor in :attr:`tensors`)."""
    hidden_size: int
    layer_widths: list[dict[str, int]]
    merged: list[str] = field(default_factory=list)
    """What was merged, in words (``"30 low-rank pairs (q, k)"``)."""
    added_params: int = 0
    """Parameters of the dense result minus the model's own (merges make the dense form larger)."""

    @property
    def uniform_widths(self) -> dict[str, int] | None:
        """The widths one config holds (each key as every layer that has it agrees; a hybrid's layers give the keys of
        the kinds they hold), or None when they vary across layers."""
        return merged_widths(self.layer_widths)

    @property
    def uniform(self) -> bool:
        return self.uniform_widths is not None


def _product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` in float32 or wider, cast back to ``left``'s dtype."""
    wide = torch.float64 if left.dtype == torch.float64 else torch.float32
    return (left.to(wide) @ right.to(wide)).to(left.dtype)


def _refuse_structures(model: nn.Module, view: ModelView, allowed_hosts: set[str]) -> None:
    """One line for what no exact dense merge exists for."""
    residual = [name for name, module in model.named_modules() if isinstance(module, BasisChange)]
    residual = [name for name in residual if name.rpartition(".")[0] not in allowed_hosts]
    if residual:
        what = "matrix" if len(residual) == 1 else "matrices"
        has = "has" if len(residual) == 1 else "have"
        raise SlimkitError(
            f"{len(residual)} residual / basis-change {what} inside the decoder "
            f"({residual[0]}{', ...' if len(residual) > 1 else ''}) {has} no exact merge into a dense Llama decoder "
            "(its residual stream has one basis); run SP3 with one layer group (group_size: all) for an exportable "
            "model, or serve it with slimkit.load"
        )
    sizes = {layer_hidden_size(layer, view.hidden_size) for layer in view.layers}
    if sizes != {view.hidden_size}:
        raise SlimkitError(
            f"per-layer hidden sizes {sorted(sizes)} (embeddings {view.hidden_size}) cannot be expressed by a dense "
            "decoder with one hidden size; serve it with slimkit.load"
        )
    norms = [name for name, module in model.named_modules() if isinstance(module, nn.RMSNorm)]
    if norms:
        raise SlimkitError(f"{len(norms)} LayerNorms converted to RMSNorm have no dense-decoder equivalent")


def dense_tensors(model: nn.Module) -> DenseModel:
    """The model's weights as a dense decoder's, merging low-rank pairs and output maps exactly.

    Raises :class:`SlimkitError` (one line) where no exact merge exists (see the module doc).
    """
    view = ModelView(model)
    embed_path = view.path_of(view.embed_tokens)
    norm = view.final_norm
    norm_path = view.path_of(norm.module) if norm is not None else None
    head = view.head
    head_path = view.path_of(head) if head is not None else None
    _refuse_structures(model, view, {embed_path} | ({norm_path} if norm_path else set()))

    tensors: dict[str, torch.Tensor] = {}
    merged: list[str] = []
    lowrank = {name: module for name, module in model.named_modules() if isinstance(module, LowRankLinear)}
    for name, module in lowrank.items():
        tensors[f"{name}.weight"] = _product(module.second.weight.detach(), module.first.weight.detach())
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach()
    if lowrank:
        roles = Counter(name.rpartition(".")[2] for name in lowrank)
        counts = ", ".join(f"{role} x{n}" for role, n in sorted(roles.items()))
        merged.append(f"{len(lowrank)} low-rank pairs into dense matrices ({counts})")
    inside_lowrank = tuple(f"{name}." for name in lowrank)
    for name, tensor in model.state_dict().items():
        if not name.startswith(inside_lowrank) and f".{BASIS_CHANGE_NAME}." not in name:
            tensors.setdefault(name, tensor.detach())

    embedding = view.embed_tokens.weight.detach()
    head_weight = head.weight.detach() if head is not None else embedding
    head_key = f"{head_path}.weight" if head_path else "lm_head.weight"
    tied = view.tied
    if tied:
        tensors.pop(head_key, None)  # state_dict lists a tied head under its own name too
    embed_map = getattr(view.embed_tokens, BASIS_CHANGE_NAME, None)
    if isinstance(embed_map, BasisChange):
        table = _product(embedding, embed_map.weight.detach().T)
        if embed_map.bias is not None:
            table = table + embed_map.bias.detach().to(table.dtype)
        tensors[f"{embed_path}.weight"] = table
        merged.append(f"the token embedding's output map {tuple(embed_map.weight.shape)} into the embedding table")
        if tied:  # the head keeps reading the table the map was folded out of
            tensors[head_key] = head_weight
            tied = False
            merged.append("the head untied from the embedding table")
    norm_map = getattr(norm.module, BASIS_CHANGE_NAME, None) if norm is not None else None
    if isinstance(norm_map, BasisChange):
        if norm_map.bias is not None:
            raise SlimkitError("the final norm's output map has a bias, which a Llama head (no bias) cannot absorb")
        tensors[head_key] = _product(head_weight, norm_map.weight.detach())
        merged.append(f"the final norm's output map {tuple(norm_map.weight.shape)} into the head (untied)")
        tied = False
    fuse_tensors(tensors, model)  # fused projections under their stock names (Phi-3's qkv_proj, gate_up_proj)
    saved = set(model.state_dict())  # persistent buffers are weights too (DeepSeek-V3's e_score_correction_bias)
    own = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if n in saved)
    added = sum(t.numel() for t in tensors.values()) - own
    return DenseModel(
        tensors=tensors,
        tied=tied,
        hidden_size=view.hidden_size,
        layer_widths=view.layer_widths(),
        merged=merged,
        added_params=added,
    )


__all__ = ["DenseModel", "dense_tensors"]
