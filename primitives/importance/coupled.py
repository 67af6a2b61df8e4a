"""Coupled-component importance (CCE, ../shared/papers/cce-coupled-components-elimination.md, Eqs. 2-6, 8).

Scores of kernels, features and components of attention heads and MLPs that are removed together, from weights,
activations and gradients (the ``coupled`` scorer).

Method note: docs/methods/cce-coupled-scores.md.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import cast

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group

COUPLED_KINDS = ("attention_head", "kv_group", "mlp_channel", "hidden_feature")
FEATURE_SCOPES = ("query_head", "kv_group", "layer")
"""Where Eq. 8 takes its absolute value under GQA (see the module docstring, "Feature importance")."""
DEFAULT_FEATURE_SCOPE = "kv_group"
GRADIENT_ROLES = ("q", "k", "v", "o", "gate", "up", "down")


def product_gradient(
    left: torch.Tensor,
    right: torch.Tensor,
    grad_left: torch.Tensor | None = None,
    grad_right: torch.Tensor | None = None,
) -> torch.Tensor:
    """The smallest G (m x n) with G right^T = grad_left and left^T G = grad_right, for W = left @ right.

    ``left`` is m x k, ``right`` k x n; pass the gradients of the factors that belong to the scored
    unit alone (at least one). With both, the core left^T G right^T is the mean of what the two
    equations say (exactly one value when they are consistent).
    """
    if grad_left is None and grad_right is None:
        raise ValueError("product_gradient needs grad_left, grad_right or both")
    right_pinv = torch.linalg.pinv(right @ right.T, hermitian=True) @ right if grad_left is not None else None
    left_pinv = left @ torch.linalg.pinv(left.T @ left, hermitian=True) if grad_right is not None else None
    if grad_right is None:
        return grad_left @ right_pinv
    if grad_left is None:
        return left_pinv @ grad_right
    core = 0.5 * (left.T @ grad_left + grad_right @ right.T)
    return grad_left @ right_pinv + left_pinv @ grad_right - left_pinv @ core @ right_pinv


def component_scores(left: torch.Tensor, right: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Eq. 6 for the components C_i = left[..., :, i] right[..., i, :] of one product with gradient ``grad``.

    ``left`` [..., m, k], ``right`` [..., k, n], ``grad`` [..., m, n] -> [..., k].
    """
    first = (left * (grad @ right.transpose(-1, -2))).sum(-2)
    second = (left * left * ((grad * grad) @ (right * right).transpose(-1, -2))).sum(-2)
    return (first - 0.5 * second).abs()


def feature_saliences(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Eq. 8's signed sum of one square product W (or a batch [..., d, d]) over row f and column f -> [..., d].

    The sum of G_c c - 1/2 (G_c c)^2 over the elements c of row f and column f (the diagonal once);
    :func:`pool_features` takes the absolute value over the chosen products.
    """
    salience = grad * weight
    salience = torch.addcmul(salience, salience, salience, value=-0.5)
    diagonal = salience.diagonal(dim1=-2, dim2=-1)
    return salience.sum(-1) + salience.sum(-2) - diagonal


def feature_scores(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Eq. 8's term of one square product W (or a batch [..., d, d]): |sum over row f and column f| -> [..., d]."""
    return feature_saliences(weight, grad).abs()


def pool_features(saliences: torch.Tensor, num_kv_heads: int, scope: str) -> torch.Tensor:
    """Eq. 8 over one layer's products of one kind (QK or VO): ``saliences`` [heads, d_m] -> [d_m].

    ``scope`` is the product whose signed sum is put in |.| (see :data:`FEATURE_SCOPES`):
    ``query_head`` sum_h |s_h|, ``kv_group`` sum_g |sum_{h in g} s_h|, ``layer`` |sum_h s_h|.
    """
    if scope == "query_head":
        return saliences.abs().sum(0)
    if scope == "kv_group":
        heads, d_m = saliences.shape
        return saliences.view(num_kv_heads, heads // num_kv_heads, d_m).sum(1).abs().sum(0)
    if scope == "layer":
        return saliences.sum(0).abs()
    raise ValueError(f"unknown feature_scope '{scope}'; allowed: {', '.join(FEATURE_SCOPES)}")


def channel_scores(
    alpha: torch.Tensor, beta: torch.Tensor, grad_alpha: torch.Tensor, grad_beta: torch.Tensor
) -> torch.Tensor:
    """Eq. 6 for rank-one components C_i = alpha_i^T beta_i with the two-sided product gradient, closed form.

    ``alpha`` [n, m] (e.g. down columns), ``beta`` [n, d] (up/gate rows) and their gradients -> [n].
    Equals :func:`component_scores` with :func:`product_gradient` of each channel (O(n (m + d)) instead
    of materialising n gradients of m x d).
    """
    a2 = (alpha * alpha).sum(1, keepdim=True).clamp_min(torch.finfo(alpha.dtype).tiny)
    b2 = (beta * beta).sum(1, keepdim=True).clamp_min(torch.finfo(beta.dtype).tiny)
    core = 0.5 * ((alpha * grad_alpha).sum(1) + (beta * grad_beta).sum(1))  # the first-order term
    # G_ab alpha_a beta_b = p_a Q_b + P_a q_b - core p_a q_b with p = alpha^2/|alpha|^2, q = beta^2/|beta|^2,
    # P = grad_alpha * alpha, Q = grad_beta * beta; the sum of its squares separates into 1-D sums.
    p, q = alpha * alpha / a2, beta * beta / b2
    big_p, big_q = grad_alpha * alpha, grad_beta * beta
    pp, qq = (p * p).sum(1), (q * q).sum(1)
    p_big_p, q_big_q = (p * big_p).sum(1), (q * big_q).sum(1)
    second = (
        pp * (big_q * big_q).sum(1)
        + (big_p * big_p).sum(1) * qq
        + core * core * pp * qq
        + 2 * p_big_p * q_big_q
        - 2 * core * pp * q_big_q
        - 2 * core * p_big_p * qq
    )
    return (core - 0.5 * second).abs()


def _kv_projectors(right: torch.Tensor) -> torch.Tensor:
    """(R R^T)^+ R for every KV head: [kv, d, n] -> [kv, d, n]."""
    gram = right @ right.transpose(-1, -2)
    return torch.linalg.pinv(gram, hermitian=True) @ right


def head_product_gradients(
    left: torch.Tensor, grad_left: torch.Tensor, right: torch.Tensor, grad_right: torch.Tensor | None = None
) -> torch.Tensor:
    """Minimum-norm gradients G_h of the head products W_h = L_h R_{g(h)} from the factors' gradients.

    ``left``/``grad_left`` [heads, m, d] (one L_h per query head), ``right`` [kv, d, n] (the KV heads,
    consecutive query heads share one), ``grad_right`` [kv, d, n] or None -> [heads, m, n].
    Solves G_h R^T = grad_left_h for every head and sum_h L_h^T G_h = grad_right for every KV group
    (Lagrange: G_h = Lambda_h R + L_h M; M keeps only the part outside R's row space, which is what
    the shared equation adds to the per-head ones).
    """
    per_group = left.shape[0] // right.shape[0]
    projector = _kv_projectors(right)  # [kv, d, n]
    grads = grad_left @ projector.repeat_interleave(per_group, dim=0)
    if grad_right is None:
        return grads
    kv, d = right.shape[0], right.shape[1]
    gram = (left.transpose(1, 2) @ left).view(kv, per_group, d, d).sum(1)  # sum_h L_h^T L_h
    seen = (left.transpose(1, 2) @ grad_left).view(kv, per_group, d, d).sum(1)  # sum_h L_h^T G_h R^T
    residual = grad_right - seen @ projector
    residual = residual - (residual @ right.transpose(1, 2)) @ projector  # outside R's row space
    multiplier = torch.linalg.pinv(gram, hermitian=True) @ residual  # [kv, d, n]
    return grads + left @ multiplier.repeat_interleave(per_group, dim=0)


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    grad_q: torch.Tensor,
    grad_o: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    grad_k: torch.Tensor | None = None,
    grad_v: torch.Tensor | None = None,
    features: bool = True,
    feature_scope: str = DEFAULT_FEATURE_SCOPE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head scores [heads] and, if asked, this layer's share of the feature scores [d_m] (Eq. 8).

    Weights as stored by ``nn.Linear``: q [heads*d_k, d_m], k and v [kv*d_k, d_m], o [d_m, heads*d_k],
    and their gradients; without ``grad_k``/``grad_v`` only the query-side equations are used. The scores
    are in ``q``'s dtype and on its device (the registered scorer passes float32 copies of the weights).
    ``feature_scope`` (:data:`FEATURE_SCOPES`): which product's signed sum Eq. 8 puts in |.|; QK and VO
    products are pooled separately and their scores added.
    """
    if feature_scope not in FEATURE_SCOPES:
        raise ValueError(f"unknown feature_scope '{feature_scope}'; allowed: {', '.join(FEATURE_SCOPES)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    d_m = q.shape[1]
    d_k = q.shape[0] // num_heads
    per_group = num_heads // num_kv_heads
    heads = torch.zeros(num_heads, dtype=q.dtype, device=q.device)
    feats = torch.zeros(d_m, dtype=q.dtype, device=q.device) if features else None
    kv_grads = (
        None if grad_k is None else grad_k.view(num_kv_heads, d_k, d_m),
        None if grad_v is None else grad_v.view(num_kv_heads, d_k, d_m),
    )
    for (left, grad_left, kv_weight), grad_right in zip(
        (
            (q.view(num_heads, d_k, d_m).transpose(1, 2), grad_q.view(num_heads, d_k, d_m).transpose(1, 2), k),
            (o.view(d_m, num_heads, d_k).permute(1, 0, 2), grad_o.view(d_m, num_heads, d_k).permute(1, 0, 2), v),
        ),
        kv_grads,
        strict=True,
    ):
        right = kv_weight.view(num_kv_heads, d_k, d_m)
        saliences = torch.zeros(num_heads, d_m, dtype=q.dtype, device=q.device) if feats is not None else None
        # one KV group at a time (its equations involve no other group): the d_m x d_m products and gradients of
        # per_group heads at once, not of every head (32 x 4096 x 4096 float32 numbers are 2 GiB a tensor)
        for group in range(num_kv_heads):
            rows = slice(group * per_group, (group + 1) * per_group)
            kv = slice(group, group + 1)
            grad = head_product_gradients(
                left[rows], grad_left[rows], right[kv], None if grad_right is None else grad_right[kv]
            )  # [per_group, d_m, d_m]
            shared = right[kv].expand(per_group, -1, -1)
            heads[rows] += component_scores(left[rows], shared, grad).sum(-1)
            if saliences is not None:
                saliences[rows] = feature_saliences(left[rows] @ shared, grad)
        if feats is not None and saliences is not None:
            feats += pool_features(saliences, num_kv_heads, feature_scope)
    return heads, feats


def mlp_scores(
    down: torch.Tensor,
    grad_down: torch.Tensor,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Channel scores [n]: the sum over input matrices (gate and up, or fc1) of the sub-component scores.

    ``down`` [d_m, n] with its gradient; ``inputs`` [(weight [n, d_m], gradient)].
    """
    alpha, grad_alpha = down.T, grad_down.T
    return cast(torch.Tensor, sum(channel_scores(alpha, beta, grad_alpha, grad_beta) for beta, grad_beta in inputs))


# -- the registered scorer ---------------------------------------------------------------------


def _weight(layer: LayerView, role: str) -> torch.Tensor:
    module = layer.linear(role)
    if not isinstance(module, nn.Linear):
        raise SlimkitError(
            f"coupled scorer: layer {layer.index} {role} is a {type(module).__name__}, not a Linear; "
            "coupled components need plain projection weights"
        )
    return module.weight


def gradient_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights whose gradients the coupled scorer reads (q, o, gate/up/fc1, down/fc2 of every layer)."""
    weights = []
    for layer in ModelView(model).layers:
        weights += [_weight(layer, role) for role in GRADIENT_ROLES if role in layer.roles]
    return weights


def roles_read(kind: str) -> tuple[str, ...]:
    """Projection roles whose weights (and gradients) the coupled scorer reads for a group kind."""
    if kind == "mlp_channel":
        return ("gate", "up", "down")
    return ("q", "k", "v", "o")


def coupled_gradient_weights(model: nn.Module, groups: list[Group]) -> list[torch.Tensor]:
    """The weights whose gradients the coupled scorer reads for ``groups`` only, so that groups a stage
    does not score (e.g. attention after a low-rank stage) need no plain Linear."""
    view = ModelView(model)
    wanted: dict[tuple[int, str], None] = {}
    for group in groups:
        layers = range(view.num_layers) if group.layer is None else [group.layer]
        for index in layers:
            for role in roles_read(group.kind):
                wanted[(index, role)] = None
    weights = []
    for index, role in wanted:
        layer = view.layer(index)
        if role in layer.roles:
            weights.append(_weight(layer, role))
    return weights


def _grad(gradients, weight: torch.Tensor) -> torch.Tensor:
    return gradients.of(weight)[0].detach().float()


def layer_attention(
    model: nn.Module, layer: int, stats: MutableMapping, feature_scope: str = DEFAULT_FEATURE_SCOPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(head scores, feature share) of one layer, memoised in ``stats["coupled"]`` by (layer, scope)."""
    cache = stats.setdefault("coupled", {})
    key = (layer, feature_scope)
    if key not in cache:
        view = ModelView(model).layer(layer)
        if view.spec.latent_attention is not None:
            raise SlimkitError(
                f"the coupled (CCE) head score is not supported for {view.spec.model_type}: it reads each head's q, k, "
                "v and o, and latent attention has no per-head key or value projection (kv_b_proj expands a shared "
                "latent); score attention_head with another scorer"
            )
        if view.spec.q_gate:
            raise SlimkitError(
                f"coupled scorer: {view.spec.model_type}'s gated attention (an output gate beside each head's query) "
                "is not one of CCE's QK/VO products; score attention heads with activation, magnitude or taylor"
            )
        gradients = stats["gradients"]
        w = {role: _weight(view, role) for role in ("q", "k", "v", "o")}
        g = {role: _grad(gradients, weight) for role, weight in w.items()}
        w = {role: weight.detach().float() for role, weight in w.items()}
        cache[key] = attention_scores(
            w["q"],
            w["k"],
            w["v"],
            w["o"],
            g["q"],
            g["o"],
            view.num_heads,
            view.num_kv_heads,
            g["k"],
            g["v"],
            feature_scope=feature_scope,
        )
    return cache[key]


def layer_mlp(model: nn.Module, layer: int, stats: Mapping) -> torch.Tensor:
    view = ModelView(model).layer(layer)
    gradients = stats["gradients"]
    down = _weight(view, "down")
    inputs = [(_weight(view, r).detach().float(), _grad(gradients, _weight(view, r))) for r in view.mlp_input_roles]
    return mlp_scores(down.detach().float(), _grad(gradients, down), inputs)


def coupled_scores(
    group: Group, model: nn.Module, stats: MutableMapping, feature_scope: str = DEFAULT_FEATURE_SCOPE, **_
) -> torch.Tensor:
    """CCE's coupled-component importance (Eqs. 2-6, 8) through the gradient on q_i k_i, v_i o_i, MLP kernels.

    ``feature_scope`` (hidden features only, :data:`FEATURE_SCOPES`): where Eq. 8 takes |.|.
    """
    if group.kind not in COUPLED_KINDS:
        raise ValueError(f"coupled scorer cannot score '{group.kind}' groups; allowed: {', '.join(COUPLED_KINDS)}")
    if feature_scope not in FEATURE_SCOPES:
        raise ValueError(f"unknown feature_scope '{feature_scope}'; allowed: {', '.join(FEATURE_SCOPES)}")
    if group.kind == "hidden_feature":
        view = ModelView(model)
        if any(layer.mixer is not None for layer in view.layers):
            raise SlimkitError(
                f"coupled scorer: {view.spec.model_type}'s gated DeltaNet / Mamba-2 layers read the stream through "
                "projections CCE's feature score (from attention products) does not model; score hidden features "
                "with activation, magnitude or taylor"
            )
        layers = range(view.num_layers)
        return cast(torch.Tensor, sum(layer_attention(model, i, stats, feature_scope)[1] for i in layers))
    if group.kind == "mlp_channel":
        return layer_mlp(model, group.layer, stats)
    heads = layer_attention(model, group.layer, stats)[0]  # head scores do not depend on the feature scope
    if group.kind == "kv_group":
        return heads.view(group.size, -1).sum(1)
    return heads


__all__ = [
    "COUPLED_KINDS",
    "DEFAULT_FEATURE_SCOPE",
    "FEATURE_SCOPES",
    "attention_scores",
    "channel_scores",
    "component_scores",
    "coupled_gradient_weights",
    "coupled_scores",
    "feature_saliences",
    "feature_scores",
    "gradient_weights",
    "head_product_gradients",
    "mlp_scores",
    "pool_features",
    "product_gradient",
]
