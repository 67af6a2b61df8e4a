"""How many components each layer group keeps, and what the projected model will count.

* :func:`uniform_widths`: every group keeps ``round((1 − ratio) d)`` components.
* :func:`variance_widths`: allocation by explained variance across groups. Every group keeps the
  fewest components whose cumulative explained fraction (of that group's own total) reaches one
  common threshold τ, and τ is chosen so the layer-weighted mean width ``Σ n_g k_g / Σ n_g`` comes
  closest to ``(1 − ratio) d``. Groups whose spectrum is concentrated (most variance in few
  components) thus get narrower than groups with a flat spectrum. (The paper learns per-block
  widths with masks; this is our one-shot rule, recorded as a choice.)
* :func:`projected_param_count`: the exact parameter count after fusing given widths, from the
  current (folded, not yet fused) model, residual matrices included; :func:`widths_for_params`
  solves widths for a parameter budget with either rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.norms import linear_param
from slimkit.primitives.projection.pca import PrincipalComponents


def uniform_widths(dim: int, groups: int, ratio: float) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise SlimkitError(f"ratio (fraction of hidden dimensions removed) must be in [0, 1), got {ratio}")
    return [max(1, min(dim, round((1.0 - ratio) * dim)))] * groups


def widths_at_threshold(components: Sequence[PrincipalComponents], threshold: float) -> list[int]:
    """Per group, the fewest components whose cumulative explained fraction reaches ``threshold``."""
    widths = []
    for c in components:
        cumulative = c.explained()
        value = torch.tensor(threshold, dtype=cumulative.dtype, device=cumulative.device) - 1e-12
        k = int(torch.searchsorted(cumulative, value)) + 1
        widths.append(min(max(k, 1), c.dim))
    return widths


def _closest(candidates: torch.Tensor, value: Callable[[float], float], target: float) -> float:
    """The candidate threshold whose (monotone non-decreasing) ``value`` comes closest to ``target``."""
    low, high = 0, candidates.numel() - 1
    while low < high:  # first candidate with value >= target
        middle = (low + high) // 2
        if value(float(candidates[middle])) < target:
            low = middle + 1
        else:
            high = middle
    options = [float(candidates[i]) for i in {max(low - 1, 0), low}]
    return min(options, key=lambda t: (abs(value(t) - target), -t))


def _thresholds(components: Sequence[PrincipalComponents]) -> torch.Tensor:
    # one number per component: searched on the CPU (components may live on the model's device)
    return torch.unique(torch.cat([c.explained().double().cpu() for c in components]))


def variance_widths(components: Sequence[PrincipalComponents], sizes: Sequence[int], ratio: float) -> list[int]:
    """Widths from one common explained-variance threshold (see module docstring)."""
    if not 0.0 <= ratio < 1.0:
        raise SlimkitError(f"ratio (fraction of hidden dimensions removed) must be in [0, 1), got {ratio}")
    dim = components[0].dim
    if ratio == 0.0:
        return [dim] * len(components)
    target = (1.0 - ratio) * dim * sum(sizes)

    def kept(threshold: float) -> float:
        return float(sum(n * k for n, k in zip(sizes, widths_at_threshold(components, threshold), strict=True)))

    return widths_at_threshold(components, _closest(_thresholds(components), kept, target))


def _per_feature(module: torch.nn.Module, width: int) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False)) // width


def projected_param_count(
    model: torch.nn.Module,
    groups: Sequence[range],
    widths: Sequence[int],
    tied_head: str = "shared",
    residual_form: str = "eq34",
) -> dict[str, int]:
    """Parameters after fusing ``widths`` (one per group) into the current model.

    ``residual_form="eq34"``: a non-final group's last down projection writes the next group's width
    (Eq. 34, see :mod:`.fuse`); ``"input"``: its own group's.

    ``total`` counts everything (tied weights once), ``residual`` the residual / basis-change matrices
    (``k_g k_{g-1}`` per group boundary, plus ``k_1 k_G`` after the final norm of a tied model, plus
    ``k_1²`` on the embedding output when a sliced tied embedding has its own basis, ``tied_head="joint"``).
    """
    view = ModelView(model)
    d = view.hidden_size
    per_feature_dense = 0
    projected = 0
    embeddings = [view.embed_tokens] + [view.base.get_submodule(p) for p in view.spec.extra_embeddings]
    for module in embeddings:
        per_feature_dense += module.weight.shape[0]
        projected += module.weight.shape[0] * widths[0]
    for g, layers in enumerate(groups):
        for index in layers:
            layer = view.layer(index)
            count = 0
            boundary = residual_form == "eq34" and index == layers[-1] and g + 1 < len(groups)
            for role in layer.roles:
                if role in ("o", "down"):
                    owner, name = linear_param(layer.linear(role), "weight", 0)
                    bias_owner, bias_name = linear_param(layer.linear(role), "bias", 0)
                    rows = getattr(owner, name).shape[1] + int(getattr(bias_owner, bias_name) is not None)
                    if role == "down" and boundary:  # written in the next group's basis
                        per_feature_dense += rows
                        projected += rows * widths[g + 1]
                    else:
                        count += rows
                else:
                    owner, name = linear_param(layer.linear(role), "weight", 1)
                    count += getattr(owner, name).shape[0]
            count += _per_feature(layer.attn_norm.module, d) + _per_feature(layer.mlp_norm.module, d)
            per_feature_dense += count
            projected += count * widths[g]
    final = view.final_norm
    if final is None:
        raise SlimkitError(f"{view.spec.model_type}: no final norm to count the projected widths through")
    final_count = _per_feature(final.module, d)
    residual = sum(widths[g] * widths[g - 1] for g in range(1, len(widths)))
    if view.head is not None and not view.tied:
        final_count += view.head.weight.shape[0]
    elif view.head is not None:
        residual += widths[0] * widths[-1]
        if (tied_head == "joint" and widths[0] < d) or tied_head == "own":
            residual += widths[0] * widths[0]
    per_feature_dense += final_count
    projected += final_count * widths[-1]
    total = view.num_params() - per_feature_dense * d + projected + residual
    return {"total": total, "residual": residual}


def widths_for_params(
    model: torch.nn.Module,
    groups: Sequence[range],
    keep_params: int,
    components: Sequence[PrincipalComponents] | None = None,
    tied_head: str = "shared",
    residual_form: str = "eq34",
) -> list[int]:
    """Widths whose projected total comes closest to ``keep_params``: uniform, or by explained variance
    when ``components`` are given."""
    d = ModelView(model).hidden_size

    def total(widths: list[int]) -> float:
        return float(projected_param_count(model, groups, widths, tied_head, residual_form)["total"])

    if components is None:
        candidates = torch.arange(1, d + 1, dtype=torch.float64)
        k = _closest(candidates, lambda k: total([int(k)] * len(groups)), keep_params)
        return [int(k)] * len(groups)
    threshold = _closest(_thresholds(components), lambda t: total(widths_at_threshold(components, t)), keep_params)
    return widths_at_threshold(components, threshold)


__all__ = [
    "projected_param_count",
    "uniform_widths",
    "variance_widths",
    "widths_at_threshold",
    "widths_for_params",
]
