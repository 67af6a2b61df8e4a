"""Bias (mean) compensation for removed inputs: FLAP's baseline correction.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct.error import Indices, as_indices

BIAS_FLAGS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "llama": {"down": ("mlp_bias", ("gate", "up", "down")), "o": ("attention_bias", ("q", "k", "v", "o"))},
    "qwen3": {"o": ("attention_bias", ("q", "k", "v", "o"))},
}
"""Per ``model_type`` and consumer role: the config flag that gives the consumer a bias, and every projection role
that flag gives one (in every layer: the flags are global). Llama's ``mlp_bias`` biases gate/up/down and
``attention_bias`` q/k/v/o; Qwen3 has ``attention_bias`` only. Mistral and Qwen2 have no flag for o/down (Qwen2's
q/k/v biases are built in), so a bias there cannot be saved for stock transformers: refused."""


def bias_compensation(weight: torch.Tensor, mean: torch.Tensor, removed: Indices) -> torch.Tensor:
    """``Δb = W[:, S] @ mean[S]`` (length ``d_out``): add it to the consumer's bias after removing ``S``."""
    if weight.dim() != 2 or mean.shape != (weight.shape[1],):
        raise ValueError(
            f"expected W (d_out x d_in) and a length-d_in mean, got {tuple(weight.shape)} and {tuple(mean.shape)}"
        )
    s = as_indices(removed, weight.shape[1], "removed").to(weight.device)
    w = weight.detach().double()[:, s]
    delta = w @ mean.detach().to(device=weight.device, dtype=torch.float64)[s]
    return delta.to(weight.dtype)


def bias_refusal(model: nn.Module, layer: object, role: str) -> str | None:
    """Why the consumer ``role`` of ``layer`` (a :class:`~slimkit.primitives.arch.LayerView`) cannot carry a bias,
    or None: it has one already (OPT with ``enable_bias``, BERT, an earlier compensation), or its architecture
    has a config flag for it (:data:`BIAS_FLAGS`)."""
    if layer.linear(role).bias is not None:  # type: ignore[attr-defined]
        return None
    model_type = getattr(model.config, "model_type", "?")
    if role in BIAS_FLAGS.get(model_type, {}):
        return None
    flags = ", ".join(f"{t} ({', '.join(r)})" for t, roles in BIAS_FLAGS.items() for r in [sorted(roles)])
    return f"{model_type} models have no config flag that gives {role} a bias (supported: {flags})"


def consumer_bias(model: nn.Module, view: object, layer: object, role: str) -> nn.Parameter:
    """The bias of ``layer``'s ``role`` projection, created first when it has none.

    Creating one sets the architecture's global flag (:data:`BIAS_FLAGS`) in ``model.config`` and gives *every*
    projection the flag covers, in every layer, a zero bias (in its weight's dtype and device), so the model
    computes the same function and loads with stock transformers. A low-rank pair gets its bias on its second
    factor (:class:`~slimkit.primitives.lowrank.LowRankLinear`). Refused (:class:`SlimkitError`) where
    :func:`bias_refusal` says so."""
    module = layer.linear(role)  # type: ignore[attr-defined]
    if module.bias is not None:
        return module.bias
    reason = bias_refusal(model, layer, role)
    if reason is not None:
        raise SlimkitError(reason)
    flag, roles = BIAS_FLAGS[model.config.model_type][role]
    for each in view.layers:  # type: ignore[attr-defined]
        for name in roles:
            target = each.linear(name)
            target = getattr(target, "second", target)  # a LowRankLinear keeps its bias on the second factor
            if target.bias is None:
                weight = target.weight
                target.bias = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
    setattr(model.config, flag, True)
    return layer.linear(role).bias  # type: ignore[attr-defined]


__all__ = ["BIAS_FLAGS", "bias_compensation", "bias_refusal", "consumer_bias"]
