"""Streamed PCA of hidden features (SP3 §3.1, Algorithm 1): principal components from a Gram matrix.

:class:`GramAccumulator` sums ``X Xᵀ`` batch by batch (no token is stored); :func:`principal_components` diagonalises
it.

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Centre = Literal["none", "token"]


@dataclass(frozen=True)
class PrincipalComponents:
    """``vectors[:, j]`` is the j-th component (d x d, orthonormal columns); ``values`` descending."""

    vectors: torch.Tensor
    values: torch.Tensor

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[0])

    def basis(self, k: int | None = None) -> torch.Tensor:
        """The first ``k`` components as a d x k matrix (all of them when ``k`` is None)."""
        return self.vectors if k is None else self.vectors[:, :k]

    def explained(self) -> torch.Tensor:
        """Cumulative explained fraction: entry ``k-1`` is the share of the total kept by ``k`` components."""
        values = self.values.clamp_min(0)
        total = values.sum()
        if total <= 0:
            return torch.arange(1, self.dim + 1, dtype=values.dtype, device=values.device) / self.dim
        return values.cumsum(0) / total


def _fix_signs(vectors: torch.Tensor) -> torch.Tensor:
    index = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors[index, torch.arange(vectors.shape[1], device=vectors.device)])
    signs[signs == 0] = 1
    return vectors * signs


def principal_components(gram: torch.Tensor, tokens: int = 1) -> PrincipalComponents:
    """Components of a (summed) Gram matrix: eigenvectors by descending eigenvalue / ``tokens``."""
    gram = gram.double()
    gram = (gram + gram.T) / 2
    values, vectors = torch.linalg.eigh(gram)
    order = torch.argsort(values, descending=True)
    return PrincipalComponents(_fix_signs(vectors[:, order]), values[order] / max(tokens, 1))


def identity_components(gram: torch.Tensor, tokens: int = 1) -> PrincipalComponents:
    """The raw hidden dimensions as "components" (Table 3's no-PCA ablation).

    The basis is a permutation matrix ordering the features by their second moment (the Gram's
    diagonal), so keeping the first ``k`` components slices the ``k`` strongest raw dimensions.
    """
    diagonal = gram.double().diagonal()
    order = torch.argsort(diagonal, descending=True)
    vectors = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)[:, order]
    return PrincipalComponents(vectors, diagonal[order] / max(tokens, 1))


def _prepare(x: torch.Tensor, centre: Centre, normalise: bool) -> torch.Tensor:
    x = x.detach().reshape(-1, x.shape[-1]).double()
    if centre == "token":
        x = x - x.mean(dim=-1, keepdim=True)
    if normalise:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True).clamp_min(1e-12))
    return x


def pca(
    features: torch.Tensor, centre: Centre = "none", normalise: bool = False, max_tokens: int | None = None
) -> PrincipalComponents:
    """Reference: components of concatenated features ``[..., d]`` by SVD (``U Σ Vᵀ = SVD(Xᵀ)``)."""
    x = _prepare(features, centre, normalise)
    if max_tokens is not None:
        x = x[:max_tokens]
    _, singular, vh = torch.linalg.svd(x, full_matrices=True)
    values = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    values[: singular.shape[0]] = singular.pow(2)
    return PrincipalComponents(_fix_signs(vh.T), values / max(x.shape[0], 1))


class GramAccumulator:
    """Streaming ``Σ_t x_t x_tᵀ`` over the tokens of feature batches ``[..., d]`` (float64).

    The sum lives on the device of the first features it sees (the model's), in float64 whatever the
    features' dtype (bfloat16/float16 activations are upcast before the product)."""

    def __init__(
        self, dim: int, centre: Centre = "none", normalise: bool = False, max_tokens: int | None = None
    ) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.centre: Centre = centre
        self.normalise = normalise
        self.max_tokens = max_tokens
        self.gram = torch.zeros(dim, dim, dtype=torch.float64)
        self.tokens = 0

    @property
    def full(self) -> bool:
        return self.max_tokens is not None and self.tokens >= self.max_tokens

    def update(self, features: torch.Tensor) -> None:
        if features.shape[-1] != self.dim:
            raise ValueError(f"features have width {features.shape[-1]}, the accumulator {self.dim}")
        if self.full:
            return
        x = _prepare(features, self.centre, self.normalise)
        if self.gram.device != x.device:
            self.gram = self.gram.to(x.device)
        if self.max_tokens is not None:
            x = x[: self.max_tokens - self.tokens]
        self.gram += x.T @ x
        self.tokens += x.shape[0]

    def components(self, basis: Literal["pca", "identity"] = "pca") -> PrincipalComponents:
        if self.tokens == 0:
            raise RuntimeError("no features were accumulated")
        rule = principal_components if basis == "pca" else identity_components
        return rule(self.gram, self.tokens)


__all__ = ["GramAccumulator", "PrincipalComponents", "identity_components", "pca", "principal_components"]
