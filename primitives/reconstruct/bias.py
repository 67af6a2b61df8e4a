"""Bias (mean) compensation for removed inputs: FLAP's baseline correction.

When input channels ``S`` of a consumer ``y = W x + b`` are removed, replacing each removed input by
its calibration mean ``x̄_S`` instead of by zero gives

    y ≈ W_K x_K + (b + W_S x̄_S),      x̄ = s / T = (1/T) Σ_t x_t,

so the consumer keeps its weights and only its bias moves by ``Δb = W[:, S] x̄_S``
(:func:`bias_compensation`). It is exact when the removed channels are constant on the data, and in
expectation it removes the mean of the output error (the remaining error is the removed channels'
fluctuation ``W_S (x_S − x̄_S)``). FLAP (An et al., 2024) adds this term after pruning.

Choices: the mean comes from a streamed sum (:class:`~.gram.MeanAccumulator` or
:class:`~.gram.GramStatistics`, ``.mean()``); the product is float64; ``Δb`` is returned in ``W``'s
dtype and on its device, and the caller decides where it lives (an existing bias, or a new one
when the consumer has none, e.g. ``down_proj`` / ``o_proj`` of llama). The optimal joint refit of
weights *and* bias is :func:`~.least_squares.refit_least_squares` on
:func:`~.gram.with_bias_column`'s augmented Gram.
"""

from __future__ import annotations

import torch

from slimkit.primitives.reconstruct.error import Indices, as_indices


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


__all__ = ["bias_compensation"]
