"""Norm handling for hidden-dimension projection: folding, untying, LayerNorm -> RMSNorm, LayerNorm form.

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.capabilities import check_operation
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import member_target

TiedHead = Literal["shared", "joint", "own", "untie"]


# -- parameters of linear modules (nn.Linear or a low-rank pair), by role --------------------------
def linear_param(module: nn.Module, param: str, dim: int) -> tuple[nn.Module, str]:
    """``(owner, name)`` of a linear module's weight along ``dim`` (0: outputs, 1: inputs) or bias."""
    sub_path, name = member_target(module, param, dim)
    return (module.get_submodule(sub_path) if sub_path else module), name


def set_param(owner: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Replace ``owner.name`` by ``value`` in the dtype and on the device of ``like`` (default: the current
    parameter), so float64 math written back keeps the model's dtype (bfloat16 stays bfloat16)."""
    reference = like if like is not None else getattr(owner, name)
    requires_grad = reference.requires_grad if reference is not None else False
    dtype = reference.dtype if reference is not None else value.dtype
    device = reference.device if reference is not None else value.device
    setattr(owner, name, nn.Parameter(value.to(device=device, dtype=dtype).contiguous(), requires_grad=requires_grad))
    if isinstance(owner, nn.Linear):
        owner.out_features, owner.in_features = owner.weight.shape
    elif isinstance(owner, nn.Embedding):
        owner.num_embeddings, owner.embedding_dim = owner.weight.shape


BLOCK_ROWS = 4096
"""Rows of a weight rewritten at a time in float64: the work beside the new matrix is one block of this many rows,
not a float64 copy of the whole matrix (a 128,256-token embedding or head would need two copies of 4 GiB each)."""


def by_row_blocks(weight: torch.Tensor, columns: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` applied to ``weight`` (n x d) a block of :data:`BLOCK_ROWS` rows at a time, each block in float64,
    into a new n x ``columns`` matrix in ``weight``'s dtype and device (``fn`` must treat rows independently)."""
    out = torch.empty(weight.shape[0], columns, dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], BLOCK_ROWS):
        out[start : start + BLOCK_ROWS] = fn(weight[start : start + BLOCK_ROWS].detach().double())
    return out


def times_basis(weight: torch.Tensor, basis: torch.Tensor, gamma: torch.Tensor | None = None) -> torch.Tensor:
    """``W diag(γ) Q`` (``weight`` n x d, ``basis`` d x k) in ``weight``'s dtype, by blocks of rows in float64."""
    basis = basis.to(weight.device, torch.float64)
    if gamma is None:
        return by_row_blocks(weight, basis.shape[1], lambda block: block @ basis)
    scale = gamma.to(weight.device, torch.float64)[None, :]
    return by_row_blocks(weight, basis.shape[1], lambda block: (block * scale) @ basis)


def scale_columns(weight: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``W diag(γ)`` in ``weight``'s dtype, by blocks of rows in float64."""
    scale = gamma.to(weight.device, torch.float64)[None, :]
    return by_row_blocks(weight, weight.shape[1], lambda block: block * scale)


def norm_params(norm: nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(γ, β)`` of a norm as float64 on its device (γ = 1 for a norm without weight; β None without bias)."""
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    device = next((p.device for p in norm.parameters()), None)
    gamma = torch.ones(width, dtype=torch.float64, device=device) if weight is None else weight.detach().double()
    return gamma, None if bias is None else bias.detach().double()


def fold_into_readers(gamma: torch.Tensor, beta: torch.Tensor | None, modules: list[nn.Module]) -> None:
    """``W ← W diag(γ)`` and ``b ← b + W β`` for every linear reading ``γ ⊙ n + β``.

    The products are float64 on the weight's device; the results keep the weight's dtype. ``W β`` of a
    plain Linear is computed in float64 (a low-rank pair is run in its own dtype)."""
    for module in modules:
        owner, name = linear_param(module, "weight", 1)
        weight = getattr(owner, name)
        with torch.no_grad():
            shift = None
            if beta is not None and bool(beta.abs().max() > 0):
                if isinstance(module, nn.Linear):
                    shift = weight.detach().double() @ beta.to(weight.device, torch.float64)
                else:
                    bias_now = getattr(module, "bias", None)
                    out = module(beta.to(weight.device, weight.dtype)[None])[0].double()
                    shift = out - (0 if bias_now is None else bias_now.detach().double())
            set_param(owner, name, scale_columns(weight, gamma))
            if shift is not None:
                bias_owner, bias_name = linear_param(module, "bias", 0)
                bias = getattr(bias_owner, bias_name)
                base = torch.zeros_like(shift) if bias is None else bias.detach().double()
                set_param(bias_owner, bias_name, base + shift, like=weight)


def readers(layer: LayerView, which: str) -> list[nn.Module]:
    """The linears reading a layer's attention norm (``which="attn"``) or MLP norm (``"mlp"``)."""
    roles = ("q", "k", "v") if which == "attn" else layer.mlp_input_roles
    return [layer.linear(role) for role in roles]


def untie_head(model: nn.Module) -> bool:
    """Give a tied head its own copy of the embedding matrix; returns whether it was tied."""
    view = ModelView(model)
    if not view.tied:
        return False
    head = view.head
    head.weight = nn.Parameter(view.embed_tokens.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text_config is not None and text_config is not model.config:
        text_config.tie_word_embeddings = False
    return True


def is_rms_norm(norm: nn.Module) -> bool:
    """``torch.nn.RMSNorm`` or a Hugging Face RMSNorm class (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...)."""
    return isinstance(norm, nn.RMSNorm) or (not isinstance(norm, nn.LayerNorm) and "rms" in type(norm).__name__.lower())


def _set_weight_ones(norm: nn.Module) -> None:
    with torch.no_grad():
        norm.weight.fill_(1.0)


def check_pre_norm(view: ModelView) -> None:
    if not view.spec.encoder:
        check_operation(view.spec, "hidden_projection")
    if view.spec.norm_placement != "pre":
        raise SlimkitError(
            f"hidden-dimension projection needs a pre-norm model; {view.spec.model_type} is post-norm "
            "(BERT-style models are SP3 part 2)"
        )
    config = view.config
    if view.spec.model_type == "opt" and (
        not getattr(config, "do_layer_norm_before", True)
        or getattr(view.base.decoder, "project_in", None) is not None
        or getattr(view.base.decoder, "project_out", None) is not None
        or view.final_norm is None
    ):
        raise SlimkitError(
            "OPT models with post-LayerNorm or project_in/project_out (e.g. opt-350m) are not supported by the "
            "hidden-dimension projection"
        )


def fold_rms_norms(model: nn.Module, tied_head: TiedHead = "joint") -> dict:
    """Fold every pre-RMSNorm's γ into the linears after it; weights become 1 (see module docstring)."""
    view = ModelView(model)
    check_pre_norm(view)
    norms = [n.module for layer in view.layers for n in (layer.attn_norm, layer.mlp_norm)]
    if not all(is_rms_norm(n) for n in [*norms, view.final_norm.module]):
        raise SlimkitError("fold_rms_norms needs RMSNorm models; convert LayerNorm models with layernorm_to_rmsnorm")
    for layer in view.layers:
        for which, norm in (("attn", layer.attn_norm.module), ("mlp", layer.mlp_norm.module)):
            gamma, _ = norm_params(norm, norm.weight.shape[0])
            fold_into_readers(gamma, None, readers(layer, which))
            _set_weight_ones(norm)
    untied = False
    final = view.final_norm.module
    if view.head is not None:
        if view.tied and tied_head == "untie":
            untied = untie_head(model)
        if not ModelView(model).tied:
            gamma, _ = norm_params(final, final.weight.shape[0])
            fold_into_readers(gamma, None, [view.head])
            _set_weight_ones(final)
    return {"untied_head": untied, "final_gamma_kept": bool(ModelView(model).tied)}


def _centre_rows(module: nn.Module) -> None:
    """Centre what ``module`` writes to the stream: ``W ← (I − 11ᵀ/d) W`` on its output dimension."""
    with torch.no_grad():
        if isinstance(module, nn.Embedding):
            centred = by_row_blocks(module.weight, module.weight.shape[1], lambda b: b - b.mean(dim=1, keepdim=True))
            set_param(module, "weight", centred)
            return
        owner, name = linear_param(module, "weight", 0)
        weight = getattr(owner, name).detach().double()
        set_param(owner, name, weight - weight.mean(dim=0, keepdim=True))
        bias_owner, bias_name = linear_param(module, "bias", 0)
        bias = getattr(bias_owner, bias_name)
        if bias is not None:
            set_param(bias_owner, bias_name, bias.detach().double() - bias.detach().double().mean())


def _rms_like(norm: nn.Module, width: int) -> nn.RMSNorm:
    reference = next(iter(norm.parameters()), None)
    eps = getattr(norm, "eps", 1e-5)
    new = nn.RMSNorm(width, eps=eps, elementwise_affine=True)
    if reference is not None:
        new = new.to(device=reference.device, dtype=reference.dtype)
    return new


def layernorm_to_rmsnorm(model: nn.Module) -> dict:
    """Convert a pre-LayerNorm model into an equivalent pre-RMSNorm one (see module docstring)."""
    view = ModelView(model)
    check_pre_norm(view)
    if view.spec.norm_kind != "layernorm" or any(is_rms_norm(layer.attn_norm.module) for layer in view.layers):
        raise SlimkitError(f"{view.spec.model_type} has no LayerNorms to convert")
    width = view.hidden_size
    untied = untie_head(model) if view.tied else False
    view = ModelView(model)
    writers: list[nn.Module] = [view.embed_tokens] + [view.base.get_submodule(p) for p in view.spec.extra_embeddings]
    for layer in view.layers:
        writers += [layer.linear("o"), layer.linear("down")]
    for module in writers:
        _centre_rows(module)
    for layer in view.layers:
        layer_path = view.path_of(layer.module)
        for which, path in (("attn", layer.spec.attn_norm), ("mlp", layer.spec.mlp_norm)):
            if path is None:  # no input norm (OLMo 2): a hidden projection is refused there before it gets here
                raise SlimkitError(f"{layer.spec.model_type} layers have no {which} input norm to fold")
            norm = layer.module.get_submodule(path)
            gamma, beta = norm_params(norm, width)
            fold_into_readers(gamma, beta, readers(layer, which))
            model.set_submodule(f"{layer_path}.{path}", _rms_like(norm, width))
    final = view.final_norm.module
    gamma, beta = norm_params(final, width)
    if view.head is not None:
        fold_into_readers(gamma, beta, [view.head])
    model.set_submodule(view.path_of(final), _rms_like(final, width))
    return {"converted_layernorm": True, "untied_head": untied}


# -- the LayerNorm form (Eqs. 5-9) -------------------------------------------------------------------
def centring_matrix(
    d: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """``R = I − (1/d) 11ᵀ`` (Eq. 7): ``R x`` subtracts each token's mean."""
    return torch.eye(d, dtype=dtype, device=device) - torch.full((d, d), 1.0 / d, dtype=dtype, device=device)


def layernorm_projection(
    basis: torch.Tensor, gamma: torch.Tensor | None = None, k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_in, P_out) = (U_kᵀ R, diag(γ) U_k)`` for components ``basis`` (d x d or d x k)."""
    u = basis.double() if k is None else basis.double()[:, :k]
    d = u.shape[0]
    gamma = torch.ones(d, dtype=torch.float64, device=u.device) if gamma is None else gamma.to(u.device, torch.float64)
    return u.T @ centring_matrix(d, device=u.device), gamma[:, None] * u


def projected_layernorm(
    x: torch.Tensor, p_in: torch.Tensor, p_out: torch.Tensor, beta: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """``P_out norm(P_in x) + β`` (Eq. 8), ``norm(z) = z / sqrt(||z||² / d + ε)`` with d the original width."""
    d = p_in.shape[1]
    z = x.double() @ p_in.T
    z = z * torch.rsqrt(z.pow(2).sum(dim=-1, keepdim=True) / d + eps)
    y = z @ p_out.T
    if beta is not None:
        y = y + beta.double()
    return y.to(x.dtype)


def residual_matrix(p_in: torch.Tensor, p_out: torch.Tensor) -> torch.Tensor:
    """``W_R = P_in⁽ⁱ⁾ P_out⁽ⁱ⁻¹⁾`` (Eq. 18), mapping the previous basis's coordinates to the next one's."""
    return p_in.double() @ p_out.to(p_in.device, torch.float64)


__all__ = [
    "BLOCK_ROWS",
    "TiedHead",
    "by_row_blocks",
    "centring_matrix",
    "check_pre_norm",
    "fold_into_readers",
    "fold_rms_norms",
    "is_rms_norm",
    "layernorm_projection",
    "layernorm_to_rmsnorm",
    "projected_layernorm",
    "readers",
    "residual_matrix",
    "scale_columns",
    "times_basis",
    "untie_head",
]
