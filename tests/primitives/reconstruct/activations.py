"""Shared inputs of the reconstruct tests: activations are rows ``x_t`` of ``X`` (``T x d``), so a module doc's
``G = X Xᵀ`` is ``X.T @ X`` here and a consumer's outputs are ``X @ W.T``."""

from __future__ import annotations

import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(tokens: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Correlated, anisotropic float64 activations (``T x d``), full column rank."""
    g = gen(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) * torch.logspace(0, -1, dim, dtype=torch.float64)
    return torch.randn(tokens, dim, generator=g, dtype=torch.float64) @ mix + 0.3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius)."""
    return float((a - b).norm() / b.norm())
