"""Column index helpers and the output error of a reconstruction, measured on a Gram matrix.

For a dense weight ``W`` (``d_out x d_in``) and any replacement acting on the same inputs,
written as a full ``d_out x d_in`` matrix ``Ŵ`` (a refit ``W'`` on kept columns ``K`` embedded with
zeros elsewhere, or a low-rank product ``L R``), the calibration output error is

    E = ||W X − Ŵ X||_F² = tr((W − Ŵ) G (W − Ŵ)ᵀ),   G = X Xᵀ,

computed in float64 without the tokens. ``relative=True`` divides by ``||W X||² = tr(W G Wᵀ)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Indices = Sequence[int] | torch.Tensor


def as_indices(indices: Indices, width: int, what: str = "indices") -> torch.Tensor:
    """``indices`` as a 1-D int64 CPU tensor, checked to be unique and in ``[0, width)`` (order kept)."""
    index = torch.as_tensor(indices, dtype=torch.long).detach().cpu().reshape(-1)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= width):
        raise ValueError(f"{what} must lie in [0, {width}), got min {int(index.min())} max {int(index.max())}")
    if index.unique().numel() != index.numel():
        raise ValueError(f"{what} must be unique")
    return index


def kept_columns(width: int, removed: Indices) -> torch.Tensor:
    """The ascending indices of ``[0, width)`` not in ``removed`` (int64)."""
    mask = torch.ones(width, dtype=torch.bool)
    mask[as_indices(removed, width, "removed")] = False
    return mask.nonzero().flatten()


def embed_columns(compact: torch.Tensor, kept: Indices, width: int) -> torch.Tensor:
    """The ``d_out x width`` matrix with ``compact[:, i]`` at column ``kept[i]`` and zeros elsewhere."""
    index = as_indices(kept, width, "kept")
    if compact.dim() != 2 or compact.shape[1] != index.numel():
        raise ValueError(f"compact has shape {tuple(compact.shape)}, expected {index.numel()} columns")
    full = compact.new_zeros(compact.shape[0], width)
    full[:, index.to(compact.device)] = compact
    return full


def output_energy(weight: torch.Tensor, gram: torch.Tensor) -> float:
    """``tr(W G Wᵀ) = ||W X||²`` (float64): the denominator of :func:`output_error`'s relative form."""
    g = gram.detach().double()
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    return float(((w @ g) * w).sum())


def output_error(
    weight: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor, relative: bool = False, energy: float | None = None
) -> float:
    """``tr((W − Ŵ) G (W − Ŵ)ᵀ)`` (float64), divided by ``tr(W G Wᵀ)`` when ``relative`` (pass that as ``energy``
    when it is already known: :func:`output_energy`).

    Only the columns where ``W`` and ``Ŵ`` differ enter the product (the others contribute exactly zero), so the error
    of a removal without a refit costs ``|S|²`` per row for ``|S|`` removed columns instead of ``d_in²``."""
    if weight.shape != approx.shape or gram.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"expected W and Ŵ of one shape and a d_in x d_in Gram, got "
            f"{tuple(weight.shape)}, {tuple(approx.shape)}, {tuple(gram.shape)}"
        )
    g = gram.detach().double()
    w = weight.detach().to(device=g.device, dtype=torch.float64)
    delta = w - approx.detach().to(device=g.device, dtype=torch.float64)
    changed = (delta != 0).any(dim=0)
    if not bool(changed.all()):
        delta, g = delta[:, changed], g[changed][:, changed]
    error = float(((delta @ g) * delta).sum())
    if not relative:
        return error
    total = output_energy(weight, gram) if energy is None else energy
    return error / total if total > 0 else (0.0 if error == 0 else float("inf"))


__all__ = ["Indices", "as_indices", "embed_columns", "kept_columns", "output_energy", "output_error"]
