"""Fusing hidden-dimension projections into the weights (SP3 §3.3, Eqs. 15–18; group PCA, F.1).

Each group of a pre-RMSNorm decoder carries its residual stream in its own basis; the readers and writers of the
stream are rewritten in it, with a residual matrix where the basis changes.

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE
from slimkit.primitives.projection.adapters import attach_basis_change, basis_changes
from slimkit.primitives.projection.norms import (
    is_rms_norm,
    linear_param,
    norm_params,
    readers,
    residual_matrix,
    set_param,
    times_basis,
)

Residual = Literal["eq34", "input"]
"""Where a group boundary's residual matrix sits (see the module docstring)."""


def layer_groups(num_layers: int, group_size: int | None) -> list[range]:
    """Consecutive groups of ``group_size`` decoder layers (the last may be shorter); None: one group."""
    if group_size is None:
        return [range(num_layers)]
    if group_size < 1:
        raise SlimkitError(f"group_size must be >= 1 or 'all', got {group_size}")
    return [range(start, min(start + group_size, num_layers)) for start in range(0, num_layers, group_size)]


def resized_rms_norm(norm: nn.Module, width: int, value: float) -> nn.Module:
    """A copy of an RMSNorm of ``width`` features with every weight entry ``value`` (ε kept)."""
    weight = norm.weight
    if isinstance(norm, nn.RMSNorm):
        new = nn.RMSNorm(width, eps=norm.eps, elementwise_affine=True, device=weight.device, dtype=weight.dtype)
    else:  # HF RMSNorm classes (LlamaRMSNorm, ...): same class, new width, other attributes kept
        new = norm.__class__.__new__(norm.__class__)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in norm.__dict__.items()})
        new._parameters = {"weight": nn.Parameter(torch.empty(width, device=weight.device, dtype=weight.dtype))}
    with torch.no_grad():
        new.weight.fill_(value)
    new.weight.requires_grad_(weight.requires_grad)
    return new


def _read_through(module: nn.Module, basis: torch.Tensor, gamma: torch.Tensor | None = None) -> None:
    """``W ← W diag(γ) Q`` on the input dimension of a linear module."""
    owner, name = linear_param(module, "weight", 1)
    set_param(owner, name, times_basis(getattr(owner, name), basis, gamma))


def _write_through(module: nn.Module, basis: torch.Tensor) -> None:
    """``W ← Qᵀ W`` and ``b ← Qᵀ b`` on the output dimension of a linear module (``Qᵀ W = (Wᵀ Q)ᵀ``, by blocks of
    ``W``'s columns)."""
    owner, name = linear_param(module, "weight", 0)
    weight = getattr(owner, name)
    set_param(owner, name, times_basis(weight.detach().T, basis).T)
    bias_owner, bias_name = linear_param(module, "bias", 0)
    bias = getattr(bias_owner, bias_name)
    if bias is not None:
        set_param(bias_owner, bias_name, basis.to(weight.device, torch.float64).T @ bias.detach().double())


def _check_fusable(view: ModelView, basis: torch.Tensor) -> None:
    if basis_changes(view.model):
        raise SlimkitError("the model already carries basis changes; project a model only once")
    if basis.shape[0] != view.hidden_size:
        raise SlimkitError(f"basis has {basis.shape[0]} rows but the hidden size is {view.hidden_size}")


def fuse_embeddings(model: nn.Module, basis: torch.Tensor) -> None:
    """``E ← E Q`` for the token embedding and any other embedding writing the stream."""
    view = ModelView(model)
    tied = view.tied
    basis = basis.double()
    with torch.no_grad():
        for module in [view.embed_tokens] + [view.base.get_submodule(p) for p in view.spec.extra_embeddings]:
            set_param(module, "weight", times_basis(module.weight, basis))
    if tied:
        view.head.weight = view.embed_tokens.weight
        view.head.in_features = view.embed_tokens.weight.shape[1]


def fuse_layer(model: nn.Module, index: int, basis: torch.Tensor, output_basis: torch.Tensor | None = None) -> None:
    """Project one decoder layer onto ``basis`` (d x k): readers, writers and its two norms.

    ``output_basis`` (d x k'): the basis its last writer (down / fc2) writes instead, for the
    boundary block of Eq. 34 (see :func:`fuse_boundary`).
    """
    view = ModelView(model)
    layer = view.layer(index)
    basis = basis.double()
    d, k = basis.shape
    layer_path = view.path_of(layer.module)
    with torch.no_grad():
        for which, path in (("attn", layer.spec.attn_norm), ("mlp", layer.spec.mlp_norm)):
            if path is None:  # no input norm (OLMo 2): fusing is refused there before it gets here
                raise SlimkitError(f"{layer.spec.model_type} layers have no {which} input norm to fuse")
            norm = layer.module.get_submodule(path)
            if not is_rms_norm(norm):
                raise SlimkitError("fusing needs RMSNorm layers; convert LayerNorm models with layernorm_to_rmsnorm")
            gamma, _ = norm_params(norm, d)
            for module in readers(layer, which):
                _read_through(module, basis, gamma)
            model.set_submodule(f"{layer_path}.{path}", resized_rms_norm(norm, k, math.sqrt(d / k)))
        _write_through(layer.linear("o"), basis)
        _write_through(layer.linear("down"), basis if output_basis is None else output_basis.double())


def branch_writer(model: nn.Module, index: int) -> str:
    """Path (inside layer ``index``) of the module whose output the layer adds to its residual last.

    The parent of the down projection when it is a sub-module (llama's ``mlp``, so hooks on
    ``down_proj`` such as masks act first), else the down projection itself (OPT's ``fc2``).
    """
    view = ModelView(model)
    layer = view.layer(index)
    path = view.path_of(layer.linear("down"))[len(view.path_of(layer.module)) + 1 :]
    parent = path.rpartition(".")[0]
    return parent or path


def fuse_boundary(
    model: nn.Module, index: int, previous: torch.Tensor, basis: torch.Tensor, residual: Residual = "eq34"
) -> torch.Tensor:
    """Attach ``W_R = Qᵀ Q_prev`` (Eq. 18) where the group starting at layer ``index`` begins; returns ``W_R``.

    ``"input"``: on the input of layer ``index``. ``"eq34"``: on the residual branch of layer
    ``index − 1``, whose writer must already write ``basis`` (``fuse_layer(..., output_basis=basis)``).
    """
    weight = residual_matrix(basis.T, previous)
    if residual == "input":
        attach_basis_change(ModelView(model).layer(index).module, weight, hook="input")
    elif residual == "eq34":
        if index < 1:
            raise SlimkitError("an Eq. 34 boundary needs a layer before the group")
        host = ModelView(model).layer(index - 1).module
        attach_basis_change(host, weight, hook="branch", writer=branch_writer(model, index - 1))
    else:
        raise SlimkitError(f"residual must be 'eq34' or 'input', got {residual!r}")
    return weight


def retarget_boundary(model: nn.Module, index: int, previous: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Point an Eq. 34 boundary fused towards the identity at the basis ``basis`` of the group at ``index``.

    For statistics taken on the projected model (:mod:`.hidden`): the boundary layer ``index − 1``
    first writes the original coordinates (``output_basis = I``, ``W_R = Q_prev``) so that the next
    group's statistics see its output; once ``basis`` is known its writer becomes ``Qᵀ W`` and
    ``W_R = Qᵀ Q_prev``. Returns the new ``W_R``.
    """
    layer = ModelView(model).layer(index - 1)
    adapter = layer.module._modules.get(BASIS_CHANGE)
    if adapter is None or adapter.hook != "branch" or adapter.out_features != basis.shape[0]:
        raise SlimkitError(f"layer {index - 1} carries no Eq. 34 boundary towards the original coordinates")
    weight = residual_matrix(basis.T, previous)
    with torch.no_grad():
        _write_through(layer.linear("down"), basis.double())
        adapter.weight = nn.Parameter(
            weight.to(adapter.weight.device, adapter.weight.dtype).contiguous(),
            requires_grad=adapter.weight.requires_grad,
        )
    return weight


def fuse_head(model: nn.Module, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor | None:
    """Final norm to k_G; untied head ``W diag(γ_F) Q_G``, or the map ``Q_1ᵀ diag(γ_F) Q_G`` for a tied one.

    Returns the map attached after the final norm (None when the head is untied or the map is I).
    """
    view = ModelView(model)
    final = view.final_norm.module
    first, last = first.double(), last.double()
    d, k = last.shape
    gamma, _ = norm_params(final, d)
    attached = None
    with torch.no_grad():
        model.set_submodule(view.path_of(final), resized_rms_norm(final, k, math.sqrt(d / k)))
        head = view.head
        if head is not None and view.tied:
            weight = first.T @ (gamma.to(first.device)[:, None] * last.to(first.device))
            if weight.shape[0] != weight.shape[1] or not torch.allclose(
                weight, torch.eye(k, dtype=weight.dtype, device=weight.device), atol=1e-12
            ):
                attach_basis_change(view.final_norm.module, weight, hook="output")
                attached = weight
        elif head is not None:
            _read_through(head, last, gamma)
    return attached


def fuse_ends(
    model: nn.Module, first: torch.Tensor, last: torch.Tensor, embedding: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Embeddings (basis ``embedding``, default ``first``), the final norm and the head (after ``last``).

    With an own embedding basis, the token embedding's output gets the map ``firstᵀ embedding``
    (returned). Models with position embeddings are not supported there (their sum would need it).
    """
    fuse_embeddings(model, first if embedding is None else embedding)
    residual = None
    if embedding is not None:
        view = ModelView(model)
        if view.spec.extra_embeddings:
            raise SlimkitError("an own embedding basis needs a model without position embeddings")
        residual = residual_matrix(first.double().T, embedding.double())
        attach_basis_change(view.embed_tokens, residual, hook="output")
    fuse_head(model, first if embedding is None else embedding, last)
    return residual


def fuse_projection(
    model: nn.Module,
    groups: Sequence[range],
    bases: Sequence[torch.Tensor],
    embedding: torch.Tensor | None = None,
    residual: Residual = "eq34",
) -> list[torch.Tensor]:
    """Fuse group bases ``bases[g]`` (d x k_g) into every weight; returns the residual matrices attached.

    ``embedding`` is the embeddings' basis (default: the first group's); when one is given, the
    embedding's output gets the residual matrix from it to the first group's basis. ``residual``:
    where the group boundaries' matrices sit (see the module docstring).
    """
    view = ModelView(model)
    if len(groups) != len(bases) or not bases:
        raise SlimkitError(f"{len(groups)} layer groups need as many bases, got {len(bases)}")
    _check_fusable(view, bases[0])
    residuals = []
    for g, layers in enumerate(groups):
        for index in layers:
            boundary = residual == "eq34" and index == layers[-1] and g + 1 < len(groups)
            fuse_layer(model, index, bases[g], bases[g + 1] if boundary else None)
        if g > 0:
            residuals.append(fuse_boundary(model, layers[0], bases[g - 1], bases[g], residual))
    first = fuse_ends(model, bases[0], bases[-1], embedding)
    return residuals if first is None else [first, *residuals]


__all__ = [
    "Residual",
    "branch_writer",
    "fuse_boundary",
    "fuse_embeddings",
    "fuse_ends",
    "fuse_head",
    "fuse_layer",
    "fuse_projection",
    "layer_groups",
    "resized_rms_norm",
    "retarget_boundary",
]
