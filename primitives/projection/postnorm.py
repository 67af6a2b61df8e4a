"""Hidden-dimension PCA projection for post-LayerNorm encoders (BERT; SP3 §3.1 Eqs. 5–9, §3.3 Eqs. 15–18).

Every hidden LayerNorm gets its own PCA basis; the model is re-represented in those bases (at full width or reduced),
with residual matrices between them.

Method note: docs/methods/sp3-postnorm.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.adapters import (
    NAME as ADAPTER_NAME,
)
from slimkit.primitives.projection.adapters import (
    BasisChange,
    attach_basis_change,
    basis_change_params,
    basis_changes,
)
from slimkit.primitives.projection.norms import centring_matrix, linear_param, norm_params, set_param
from slimkit.primitives.projection.pca import GramAccumulator, PrincipalComponents

Batch = torch.Tensor | Mapping[str, torch.Tensor]
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# Heads that read only the pooled output (the pooler is a reader of the last stream).
_POOLED_HEADS = ("BertModel", "BertForSequenceClassification", "BertForMultipleChoice", "BertForNextSentencePrediction")


# -- where things are ---------------------------------------------------------------------------------
def _check_post_norm(view: ModelView) -> None:
    if view.spec.norm_placement != "post" or view.spec.model_type != "bert":
        raise SlimkitError(
            f"post-norm projection handles BERT encoders; {view.spec.model_type} is "
            f"{view.spec.norm_placement}-norm (use project_hidden_dimension for pre-norm decoders)"
        )


def _parent_path(path: str) -> str:
    return path.rpartition(".")[0]


def hidden_norms(model: nn.Module) -> list[str]:
    """Paths (in ``model``) of the hidden norms j = 0..2L: embeddings, then per layer attention and output."""
    view = ModelView(model)
    _check_post_norm(view)
    base = view.path_of(view.base)
    prefix = f"{base}." if base else ""
    paths = [prefix + norm for norm in view.spec.extra_norms]
    layers = view.path_of(view.layer_list)
    for index in range(view.num_layers):
        paths += [f"{layers}.{index}.{view.spec.attn_norm}", f"{layers}.{index}.{view.spec.mlp_norm}"]
    return paths


def _writers(view: ModelView, j: int) -> list[nn.Module]:
    """Modules whose outputs are summed into norm j's input (besides the residual)."""
    if j == 0:
        return [view.embed_tokens] + [view.base.get_submodule(p) for p in view.spec.extra_embeddings]
    layer = view.layer((j - 1) // 2)
    return [layer.linear("o" if j % 2 else "down")]


def _readers(view: ModelView, j: int, restored: bool) -> list[nn.Module]:
    """Linears reading stream j (the output of norm j)."""
    if j == 2 * view.num_layers:
        pooler = getattr(view.base, "pooler", None)
        return [] if pooler is None or restored else [pooler.dense]
    if j % 2 == 0:
        layer = view.layer(j // 2)
        return [layer.linear(role) for role in ("q", "k", "v")]
    return [view.layer(j // 2).linear("up")]


def _residual_host(view: ModelView, j: int) -> nn.Module:
    """The module adding stream j-1 as ``input_tensor`` to norm j's input (``BertSelfOutput``/``BertOutput``)."""
    layer = view.layer((j - 1) // 2)
    return layer.module.get_submodule(_parent_path(layer.linear_path("o" if j % 2 else "down")))


def _residual(view: ModelView, j: int) -> BasisChange | None:
    return _residual_host(view, j)._modules.get(ADAPTER_NAME)


# -- statistics ----------------------------------------------------------------------------------------
def _model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise SlimkitError("calibration batches must be token-id tensors or mappings with 'input_ids'")
    return {k: batch[k] for k in _MODEL_INPUTS if batch.get(k) is not None}


def input_grams(
    model: nn.Module,
    paths: Sequence[str],
    batches: Iterable[Batch],
    max_tokens: int | None = None,
    *,
    centre: Literal["token", "none"] = "token",
    with_ones: bool = False,
) -> list[GramAccumulator]:
    """Streamed Gram matrices of the inputs of the modules at ``paths`` over non-padding tokens, one per module.

    ``batches`` are token-id tensors or tokenizer-style mappings (``input_ids``, optional
    ``attention_mask``, ``token_type_ids``, ``position_ids``); tokens with ``attention_mask == 0`` are
    skipped. ``centre``: ``token`` accumulates ``R y`` (each token centred), ``none`` the raw inputs;
    ``with_ones`` appends a constant 1 to every token (``[y, 1]``: a bias becomes one more input column).
    The model runs in eval mode (no dropout) and is put back in its previous mode.
    """
    modules = [model.get_submodule(p) for p in paths]
    current: dict[str, torch.Tensor | None] = {"mask": None}
    accumulators: dict[int, GramAccumulator] = {}

    def hook(index: int):
        def update(_module, args, kwargs):
            y = (args[0] if args else kwargs["hidden_states"]).detach()
            mask = current["mask"]
            y = y.reshape(-1, y.shape[-1]) if mask is None else y[mask]
            if with_ones:
                y = torch.cat([y, y.new_ones(y.shape[0], 1)], dim=1)
            if index not in accumulators:
                accumulators[index] = GramAccumulator(y.shape[-1], centre=centre, max_tokens=max_tokens)
            accumulators[index].update(y)

        return update

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = to_input_device(model, _model_inputs(batch))
                mask = inputs.get("attention_mask")
                current["mask"] = None if mask is None else mask.to(torch.bool)
                model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    if len(accumulators) < len(paths) or accumulators[0].tokens == 0:
        raise SlimkitError("the projection got no calibration tokens")
    return [accumulators[i] for i in range(len(paths))]


def norm_statistics(model: nn.Module, batches: Iterable[Batch], max_tokens: int | None = None) -> list[GramAccumulator]:
    """Streamed Gram matrices of ``R y_j`` (y_j: norm j's input) over non-padding tokens, for every hidden norm
    (:func:`input_grams`)."""
    return input_grams(model, hidden_norms(model), batches, max_tokens)


# -- fusing (Eqs. 8, 15-18) ------------------------------------------------------------------------------
def _read(module: nn.Module, into: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> None:
    """``W ← W diag(γ) U``, ``b ← b + W β`` (W the weight before the change)."""
    owner, name = linear_param(module, "weight", 1)
    weight = getattr(owner, name)
    w = weight.detach().double()
    if beta is not None:
        bias_owner, bias_name = linear_param(module, "bias", 0)
        bias = getattr(bias_owner, bias_name)
        base = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if bias is None else bias.detach().double()
        set_param(bias_owner, bias_name, base + w @ beta.to(w.device, torch.float64), like=weight)
    set_param(owner, name, (w * gamma.to(w.device, torch.float64)[None, :]) @ into.to(w.device, torch.float64))


def _write(module: nn.Module, p_in: torch.Tensor, shift: torch.Tensor | None = None) -> None:
    """``W ← P W``, ``b ← P b (+ shift)`` on the output side of a linear, or ``E ← E Pᵀ`` for an embedding."""
    if isinstance(module, nn.Embedding):
        set_param(module, "weight", module.weight.detach().double() @ p_in.to(module.weight.device).T)
        return
    owner, name = linear_param(module, "weight", 0)
    weight = getattr(owner, name)
    p_in = p_in.to(weight.device, torch.float64)
    set_param(owner, name, p_in @ weight.detach().double())
    bias_owner, bias_name = linear_param(module, "bias", 0)
    bias = getattr(bias_owner, bias_name)
    new = None if bias is None else p_in @ bias.detach().double()
    if shift is not None:
        shift = shift.to(weight.device, torch.float64)
        new = shift if new is None else new + shift
    if new is not None:
        set_param(bias_owner, bias_name, new, like=weight)


def _rms_norm(eps: float, weight: torch.Tensor, like: torch.Tensor) -> nn.RMSNorm:
    norm = nn.RMSNorm(weight.shape[0], eps=eps, elementwise_affine=True, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.weight.requires_grad_(like.requires_grad)
    return norm


def _check_widths(widths: Sequence[int] | None, count: int, d: int) -> list[int]:
    if widths is None:
        return [d] * count
    widths = [int(k) for k in widths]
    if len(widths) != count:
        raise SlimkitError(f"{count} hidden norms need as many widths, got {len(widths)}")
    if any(not 1 <= k <= d for k in widths):
        raise SlimkitError(f"widths must lie in [1, {d}], got {widths}")
    return widths


def _check_head(model: nn.Module, restore_output: bool) -> None:
    if restore_output or type(model).__name__ in _POOLED_HEADS:
        return
    raise SlimkitError(
        f"{type(model).__name__} reads the sequence output, which stays in projected coordinates; "
        "pass restore_output=True"
    )


def project_post_norm(
    model: nn.Module,
    batches: Iterable[Batch],
    widths: Sequence[int] | None = None,
    *,
    basis: Literal["pca", "identity"] = "pca",
    restore_output: bool = False,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Project every hidden norm of a post-norm BERT onto its principal components, in place (Eqs. 8, 15–18).

    ``widths[j]`` keeps the top k_j components of hidden norm j (None: all, an exact
    re-representation). ``basis="identity"`` uses the raw dimensions ordered by their centred second
    moment (the no-PCA ablation). ``restore_output`` maps the last stream back to the original
    coordinates after the last norm (see the module docstring); ``max_tokens`` caps the tokens per
    Gram matrix (the paper's T). Returns a report: the norms' paths, widths and explained variance
    fractions, the residual-matrix parameters, and the parameter counts with and without them.
    """
    view = ModelView(model)
    _check_post_norm(view)
    _check_head(model, restore_output)
    if basis_changes(model):
        raise SlimkitError("the model already carries basis changes; project a model only once")
    paths = hidden_norms(model)
    norms = [model.get_submodule(p) for p in paths]
    if not all(isinstance(n, nn.LayerNorm) for n in norms):
        raise SlimkitError("post-norm projection needs the model's original LayerNorms")
    d = view.hidden_size
    widths = _check_widths(widths, len(paths), d)
    accumulators = norm_statistics(model, batches, max_tokens)
    components: list[PrincipalComponents] = [acc.components(basis) for acc in accumulators]
    us = [c.basis(k) for c, k in zip(components, widths, strict=True)]
    device = us[0].device  # where the statistics were taken: the model's (first norm's) device
    r = centring_matrix(d, device=device)
    p_ins = [u.T @ r for u in us]  # U_jᵀ R  (k_j x d)
    params = [norm_params(n, d) for n in norms]  # (γ_j, β_j) in float64
    zero = torch.zeros(d, dtype=torch.float64, device=device)
    gammas = [g.to(device) for g, _ in params]
    betas = [zero if b is None else b.to(device) for _, b in params]
    last = len(paths) - 1

    with torch.no_grad():
        for j in range(len(paths)):
            # Writers of norm j's input; the residual constant U_jᵀ R β_{j-1} goes into the block's bias.
            shift = None if j == 0 else p_ins[j] @ betas[j - 1]
            for module in _writers(view, j):
                _write(module, p_ins[j], shift)
            if j > 0:
                w_r = p_ins[j] @ (gammas[j - 1][:, None] * us[j - 1])  # Eq. 18: U_jᵀ R diag(γ_{j-1}) U_{j-1}
                attach_basis_change(_residual_host(view, j), w_r, hook="residual")
            for module in _readers(view, j, restore_output):
                _read(module, us[j], gammas[j], betas[j])
        for path, norm, k in zip(paths, norms, widths, strict=True):
            weight = torch.full((k,), math.sqrt(d / k), dtype=torch.float64)
            model.set_submodule(path, _rms_norm(norm.eps * d / k, weight, norm.weight))
        if restore_output:
            attach_basis_change(
                model.get_submodule(paths[last]), gammas[last][:, None] * us[last], betas[last], hook="output"
            )

    residual = basis_change_params(model)
    total = sum(p.numel() for p in model.parameters())
    return {
        "hidden_size": d,
        "norms": paths,
        "widths": widths,
        "explained": [float(c.explained()[k - 1]) for c, k in zip(components, widths, strict=True)],
        "basis": basis,
        "restore_output": restore_output,
        "tokens": accumulators[0].tokens,
        # fewer tokens than d: the Gram is rank-deficient, components past its rank are arbitrary
        "rank_deficient": accumulators[0].tokens < d,
        "residual_matrices": len(basis_changes(model)),
        "residual_params": residual,
        "params": total,
        "params_without_residual": total - residual,
    }


# -- slicing a projected model (the Pr of Eqs. 15-18) ----------------------------------------------------
def _slice_out(module: nn.Module, keep: torch.Tensor) -> None:
    if isinstance(module, nn.Embedding):
        set_param(module, "weight", module.weight.detach()[:, keep])
        return
    owner, name = linear_param(module, "weight", 0)
    set_param(owner, name, getattr(owner, name).detach()[keep])
    bias_owner, bias_name = linear_param(module, "bias", 0)
    bias = getattr(bias_owner, bias_name)
    if bias is not None:
        set_param(bias_owner, bias_name, bias.detach()[keep])


def _slice_in(module: nn.Module, keep: torch.Tensor) -> None:
    owner, name = linear_param(module, "weight", 1)
    set_param(owner, name, getattr(owner, name).detach()[:, keep])


def _slice_adapter(adapter: BasisChange, rows: torch.Tensor | None, cols: torch.Tensor | None) -> None:
    weight = adapter.weight.detach()
    if rows is not None:
        weight = weight[rows]
        if adapter.bias is not None:
            set_param(adapter, "bias", adapter.bias.detach()[rows])
    if cols is not None:
        weight = weight[:, cols]
    set_param(adapter, "weight", weight)


def slice_post_norm_hidden(model: nn.Module, keep: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Keep coordinates ``keep[j]`` (sorted 1-D indices) of every hidden norm j of a projected model, in place.

    Writers lose output rows, readers input columns, residual matrices rows ``keep[j]`` and columns
    ``keep[j-1]``, the restoring output map (if any) columns ``keep[2L]``. Norm j (width n) becomes
    width k with weight ``weight[keep] * sqrt(n/k)`` and ε ``ε · n/k``, which equals the width-n norm
    applied to a vector that is zero outside ``keep[j]``; so the sliced model equals the projected one
    with the input and the output of every norm j multiplied by the 0/1 mask of ``keep[j]``.
    Returns the new widths and parameter counts.
    """
    view = ModelView(model)
    _check_post_norm(view)
    paths = hidden_norms(model)
    norms = [model.get_submodule(p) for p in paths]
    if not all(isinstance(n, nn.RMSNorm) for n in norms):
        raise SlimkitError("slice_post_norm_hidden needs a model projected by project_post_norm")
    if len(keep) != len(paths):
        raise SlimkitError(f"{len(paths)} hidden norms need as many index sets, got {len(keep)}")
    keep = [torch.as_tensor(k, dtype=torch.long).flatten() for k in keep]
    for j, (k, norm) in enumerate(zip(keep, norms, strict=True)):
        n = int(norm.weight.shape[0])
        if k.numel() == 0 or bool((k[1:] <= k[:-1]).any()) or int(k.min()) < 0 or int(k.max()) >= n:
            raise SlimkitError(f"keep[{j}] must be sorted distinct indices in [0, {n}) and not empty")
    restored = ADAPTER_NAME in norms[-1]._modules
    with torch.no_grad():
        for j, (k, norm) in enumerate(zip(keep, norms, strict=True)):
            for module in _writers(view, j):
                _slice_out(module, k)
            if j > 0:
                adapter = _residual(view, j)
                if adapter is None:
                    raise SlimkitError(f"hidden norm {j} has no residual matrix; project the model first")
                _slice_adapter(adapter, k, keep[j - 1])
            for module in _readers(view, j, restored):
                _slice_in(module, k)
            n, width = int(norm.weight.shape[0]), int(k.numel())
            set_param(norm, "weight", norm.weight.detach()[k] * math.sqrt(n / width))
            norm.normalized_shape = (width,)
            norm.eps = (norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps) * n / width
        if restored:
            _slice_adapter(norms[-1]._modules[ADAPTER_NAME], None, keep[-1])
    residual = basis_change_params(model)
    total = sum(p.numel() for p in model.parameters())
    return {
        "widths": [int(k.numel()) for k in keep],
        "residual_params": residual,
        "params": total,
        "params_without_residual": total - residual,
    }


__all__ = ["hidden_norms", "norm_statistics", "project_post_norm", "slice_post_norm_hidden"]
