"""Streamed statistics for reconstruction: Gram matrices, cross terms and input sums.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from slimkit.primitives.projection.pca import GramAccumulator


def _rows(features: torch.Tensor, dim: int, what: str = "features") -> torch.Tensor:
    if features.dim() < 1 or features.shape[-1] != dim:
        raise ValueError(f"{what} have width {features.shape[-1] if features.dim() else 0}, the accumulator {dim}")
    return features.detach().reshape(-1, dim)


class MeanAccumulator:
    """Streaming ``s = Σ_t x_t`` (float64) and token count ``T`` over batches ``[..., d]``."""

    def __init__(self, dim: int) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = dim
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.tokens = 0

    def update(self, features: torch.Tensor) -> None:
        x = _rows(features, self.dim).double()
        if self.sum.device != x.device:
            self.sum = self.sum.to(x.device)
        self.sum += x.sum(dim=0)
        self.tokens += x.shape[0]

    def mean(self) -> torch.Tensor:
        """``s / T`` (float64); raises when nothing was accumulated."""
        if self.tokens == 0:
            raise RuntimeError("no features were accumulated")
        return self.sum / self.tokens


class GramStatistics:
    """``G = Σ_t x_t x_tᵀ``, ``s = Σ_t x_t`` and ``T`` of a module's inputs, streamed (float64).

    ``max_tokens`` stops accumulating after that many tokens (taken in order), for both sums."""

    def __init__(self, dim: int, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self._gram = GramAccumulator(dim)
        self._mean = MeanAccumulator(dim)
        self.dim = dim
        self.max_tokens = max_tokens

    @property
    def gram(self) -> torch.Tensor:
        """``Σ_t x_t x_tᵀ`` (``d x d``, float64)."""
        return self._gram.gram

    @property
    def sum(self) -> torch.Tensor:
        """``Σ_t x_t`` (``d``, float64)."""
        return self._mean.sum

    @property
    def tokens(self) -> int:
        return self._gram.tokens

    @property
    def full(self) -> bool:
        return self.max_tokens is not None and self.tokens >= self.max_tokens

    def update(self, features: torch.Tensor) -> None:
        x = _rows(features, self.dim)
        if self.max_tokens is not None:
            x = x[: max(self.max_tokens - self.tokens, 0)]
        if x.shape[0] == 0:
            return
        x = x.double()
        self._gram.update(x)
        self._mean.update(x)

    def mean(self) -> torch.Tensor:
        """Mean input ``s / T`` (float64)."""
        return self._mean.mean()

    def second_moment(self) -> torch.Tensor:
        """``G / T``, the per-token second moment (float64)."""
        if self.tokens == 0:
            raise RuntimeError("no features were accumulated")
        return self.gram / self.tokens


class CrossGramAccumulator:
    """Streaming ``C = Σ_t a_t b_tᵀ`` (``d_a x d_b``, float64) over paired batches of the same tokens.

    Pass ``a`` = what the target is computed from and ``b`` = the inputs the refit will use, e.g.
    ``a`` = the dense model's input to a consumer and ``b`` = the compressed model's input to it
    (then :func:`~slimkit.primitives.reconstruct.least_squares.refit_to_dense` takes ``C``), or
    ``a`` = the dense outputs ``y`` themselves (then
    :func:`~slimkit.primitives.reconstruct.solve.damped_solve` solves ``C (G_b + λI)⁻¹``)."""

    def __init__(self, dim_a: int, dim_b: int) -> None:
        if dim_a < 1 or dim_b < 1:
            raise ValueError(f"dims must be >= 1, got {dim_a} and {dim_b}")
        self.dim_a = dim_a
        self.dim_b = dim_b
        self.cross = torch.zeros(dim_a, dim_b, dtype=torch.float64)
        self.tokens = 0

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape[:-1] != b.shape[:-1]:
            raise ValueError(f"paired batches must share their leading dims, got {tuple(a.shape)} and {tuple(b.shape)}")
        xa = _rows(a, self.dim_a, "a features").double()
        xb = _rows(b, self.dim_b, "b features").to(device=xa.device, dtype=torch.float64)
        if self.cross.device != xa.device:
            self.cross = self.cross.to(xa.device)
        self.cross += xa.T @ xb
        self.tokens += xa.shape[0]


def with_bias_column(gram: torch.Tensor, input_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """The Gram matrix of ``[x; 1]``: ``[[G, s], [sᵀ, T]]`` (``(d+1) x (d+1)``, float64).

    A layer ``y = W x + b`` is ``y = [W, b] [x; 1]``, so refitting ``[W, b]`` against this Gram with
    the constant column kept (index ``d``) refits the bias jointly with the weights: the optimal
    affine reconstruction, of which mean compensation (:mod:`.bias`) is the special case that keeps
    the weights fixed."""
    d = gram.shape[0]
    if gram.shape != (d, d) or input_sum.shape != (d,):
        raise ValueError(
            f"expected a d x d Gram and a length-d sum, got {tuple(gram.shape)} and {tuple(input_sum.shape)}"
        )
    out = torch.zeros(d + 1, d + 1, dtype=torch.float64, device=gram.device)
    out[:d, :d] = gram.double()
    s = input_sum.to(device=gram.device, dtype=torch.float64)
    out[:d, d] = s
    out[d, :d] = s
    out[d, d] = float(tokens)
    return out


@contextmanager
def gram_hooks(modules: Mapping[str, nn.Module], max_tokens: int | None = None) -> Iterator[dict[str, GramStatistics]]:
    """Attach a :class:`GramStatistics` to the first positional input of each module while the block runs.

    The width is taken from ``in_features`` when the module has it, else from the first input seen."""
    stats: dict[str, GramStatistics] = {}

    def hook(name: str):
        def update(_module: nn.Module, args: tuple) -> None:
            x = args[0]
            if name not in stats:
                stats[name] = GramStatistics(int(x.shape[-1]), max_tokens)
            stats[name].update(x)

        return update

    for name, module in modules.items():
        width = getattr(module, "in_features", None)
        if isinstance(width, int):
            stats[name] = GramStatistics(width, max_tokens)
    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules.items()]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["CrossGramAccumulator", "GramStatistics", "MeanAccumulator", "gram_hooks", "with_bias_column"]
