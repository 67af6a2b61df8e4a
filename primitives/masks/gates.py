"""Hard-concrete (L0) gates, the entries of SP3's masks (Hu et al., SP3, §2.2).

Method note: docs/methods/masks-hard-concrete.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# -- hard-concrete gates --------------------------------------------------------------------------


@dataclass(frozen=True)
class HardConcreteConfig:
    """Temperature ``beta`` and stretch interval ``(left, right)`` of a hard-concrete gate."""

    beta: float = 2.0 / 3.0
    left: float = -0.1
    right: float = 1.1
    eps: float = 1e-6
    """``u`` is drawn from ``U(eps, 1 − eps)`` so ``log u`` and ``log(1 − u)`` stay finite."""

    def __post_init__(self) -> None:
        if not (self.beta > 0 and self.left < 0 and self.right > 1 and 0 < self.eps < 0.5):
            raise ValueError(f"need beta > 0, left < 0 < 1 < right and 0 < eps < 0.5, got {self}")


DEFAULT_CONFIG = HardConcreteConfig()


def hard_concrete_sample(
    log_alpha: torch.Tensor, u: torch.Tensor | None = None, config: HardConcreteConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """One reparameterised draw ``z ∈ [0, 1]`` per entry of ``log_alpha`` (Louizos Eqs. 9–10).

    ``u`` are the uniforms (drawn here when omitted); they are clamped to ``[eps, 1 − eps]``.
    """
    if u is None:
        u = torch.rand_like(log_alpha)
    u = u.to(log_alpha.dtype).clamp(config.eps, 1.0 - config.eps)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / config.beta)
    return (s * (config.right - config.left) + config.left).clamp(0.0, 1.0)


def hard_concrete_deterministic(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Eval-time value ``min(1, max(0, σ(log α)(r − l) + l))`` (Louizos Eq. 13), in ``[0, 1]``."""
    return (torch.sigmoid(log_alpha) * (config.right - config.left) + config.left).clamp(0.0, 1.0)


def kept_value(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """CoFi's value of a gate that survives binarisation: ``σ(0.8 log α / β)``, in ``(0, 1)``, never 0.

    Louizos' deterministic value clamps at 0 for ``log α < −β logit(−l/(r−l))``; a gate kept by the
    threshold of :func:`~slimkit.primitives.masks.sparsity.binarize` (a ranking) may lie there when
    the masks overshot the target during training, and a kept unit of value 0 is a removed one.
    """
    return torch.sigmoid(0.8 * log_alpha / config.beta)


def keep_probability(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """``P(z ≠ 0) = σ(log α − β log(−l / r))``: the expected L0 norm of each gate (Louizos Eq. 12)."""
    return torch.sigmoid(log_alpha - config.beta * math.log(-config.left / config.right))


def one_probability(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """``P(z = 1) = σ(log α − β log((1 − l) / (r − 1)))``: the mass clamped at 1."""
    return torch.sigmoid(log_alpha - config.beta * math.log((1.0 - config.left) / (config.right - 1.0)))


def expected_value(
    log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG, points: int = 2049
) -> torch.Tensor:
    """``E[z]`` by Simpson's rule on ``E[z] = ∫₀¹ P(z > y) dy = ∫₀¹ σ(log α − β logit((y − l)/(r − l))) dy``.

    The integrand is smooth on ``[0, 1]`` (its argument stays inside ``(0, 1)``), so a few thousand
    points give float64 accuracy far beyond any sampling test. ``points`` is made odd.
    """
    points = points + 1 - points % 2
    y = torch.linspace(0.0, 1.0, points, dtype=torch.float64, device=log_alpha.device)
    s = (y - config.left) / (config.right - config.left)
    tail = torch.sigmoid(log_alpha.detach().double().unsqueeze(-1) - config.beta * torch.logit(s))
    weights = torch.ones_like(y)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return ((tail * weights).sum(-1) / (3.0 * (points - 1))).to(log_alpha.dtype)


def log_alpha_for_drop(drop: float) -> float:
    """CoFi's initial location for a drop rate ``p``: ``log(1 − p) − log p``."""
    if not 0.0 < drop < 1.0:
        raise ValueError(f"initial drop rate must be in (0, 1), got {drop}")
    return math.log(1.0 - drop) - math.log(drop)


class HardConcrete(nn.Module):
    """A tensor of hard-concrete gates with learned ``log_alpha`` of shape ``shape``.

    ``forward()`` samples in training mode and returns the deterministic values in eval mode.
    ``log_alpha`` is float32 whatever the model's dtype (move the module to the model's device); the
    uniform noise comes from a seeded CPU generator and is moved there, and the hooks cast the values
    to the activations' dtype where they multiply them. Gates never become model parameters.
    """

    def __init__(
        self,
        shape: Sequence[int] | int,
        *,
        config: HardConcreteConfig = DEFAULT_CONFIG,
        init_drop: float = 0.5,
        init_std: float = 0.01,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        self.config = config
        self.generator = generator
        init = torch.randn(shape, generator=generator) * init_std + log_alpha_for_drop(init_drop)
        self.log_alpha = nn.Parameter(init)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.log_alpha.shape)}, beta={self.config.beta:.4g}"

    def sample(self) -> torch.Tensor:
        u = torch.rand(self.log_alpha.shape, generator=self.generator, dtype=torch.float64)
        return hard_concrete_sample(self.log_alpha, u.to(self.log_alpha.device), self.config)

    def deterministic(self) -> torch.Tensor:
        return hard_concrete_deterministic(self.log_alpha, self.config)

    def kept_value(self) -> torch.Tensor:
        return kept_value(self.log_alpha.detach(), self.config)

    def keep_prob(self) -> torch.Tensor:
        return keep_probability(self.log_alpha, self.config)

    def forward(self) -> torch.Tensor:
        return self.sample() if self.training else self.deterministic()
