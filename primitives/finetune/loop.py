"""The optimiser step every slimkit training run shares: LoRA, distillation, GLUE fine-tuning, mask training and
the PruneNet policy.

* :class:`FloatMaster`: float32 master copies of half-precision trained weights (AdamW's moments and small updates
  in float32; the model's parameters never change dtype).
* :class:`Divergence`: how a run names a divergence in its one-line error ("``what`` diverged at step N: ...").
* :func:`checked_backward`: the loss is checked finite *before* an update, then gradients are cleared and
  computed; :func:`master_step` clips and steps through the float32 masters.
* :func:`non_finite` / :func:`non_finite_problem`: after the last update, the trained tensors are checked for
  NaN/inf (the per-step loss check cannot see what the last update did).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from slimkit.primitives.errors import SlimkitError

_HALF = (torch.float16, torch.bfloat16)


class FloatMaster:
    """float32 master copies of half-precision trainable parameters (the usual mixed-precision recipe).

    An optimiser stepping bfloat16/float16 weights directly loses small updates to round-off (a
    learning rate of 1e-5 is below bfloat16's resolution) and keeps its moments in the same low
    precision. Build the optimiser over :attr:`params` instead: float32 copies of the half-precision
    parameters (other parameters are used as they are). After ``loss.backward()`` call
    :meth:`grads_to_master`, step the optimiser, then :meth:`master_to_model` writes the updated
    values back in the model's dtype, on its device. The model's parameters never change dtype.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in params:
            if p.dtype in _HALF:
                master = p.detach().float().clone().requires_grad_(True)
                self.pairs.append((p, master))
            else:
                self.pairs.append((p, p))
        self.params = [master for _p, master in self.pairs]

    @property
    def active(self) -> bool:
        """Whether any parameter has a float32 copy."""
        return any(p is not m for p, m in self.pairs)

    def grads_to_master(self) -> None:
        for p, master in self.pairs:
            if p is not master:
                master.grad = None if p.grad is None else p.grad.detach().float()

    def master_to_model(self) -> None:
        with torch.no_grad():
            for p, master in self.pairs:
                if p is not master:
                    p.copy_(master)


@dataclass(frozen=True)
class Divergence:
    """A run's divergence error: ``"{what} diverged at {unit} N: {problem}; {hint}"``."""

    what: str
    hint: str
    unit: str = "step"

    def error(self, step: int, problem: str) -> SlimkitError:
        """The one-line error of a run that diverged at (1-based) ``step``."""
        return SlimkitError(f"{self.what} diverged at {self.unit} {step}: {problem}; {self.hint}")


def learning_rate_hint(learning_rate: float, name: str = "learning_rate") -> str:
    """The usual advice of a :class:`Divergence`: ``"lower learning_rate (got 0.001)"``."""
    return f"lower {name} (got {learning_rate:g})"


class HasZeroGrad(Protocol):
    def zero_grad(self, set_to_none: bool = True) -> None: ...


def checked_backward(loss: torch.Tensor, step: int, divergence: Divergence, clear: Iterable[HasZeroGrad]) -> float:
    """The loss's value after checking it is finite (else ``divergence``'s error at ``step``); then the gradients of
    ``clear`` (optimisers, modules) are cleared and ``loss.backward()`` computes new ones."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise divergence.error(step, f"loss {value}")
    for item in clear:
        item.zero_grad(set_to_none=True)
    loss.backward()
    return value


def master_step(master: FloatMaster, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
    """One optimiser step through float32 masters: gradients copied up, clipped (``max_grad_norm``), stepped, and
    the new values written back into the model's weights."""
    master.grads_to_master()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(master.params, max_grad_norm)
    optimizer.step()
    master.master_to_model()


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding NaN or inf (one ``torch.isfinite`` pass per tensor)."""
    with torch.no_grad():
        return [name for name, tensor in named if not bool(torch.isfinite(tensor).all())]


def name_list(names: list[str]) -> str:
    """The first three ``names``, then ``...`` when there are more."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def non_finite_problem(named: Iterable[tuple[str, torch.Tensor]], noun: str) -> str | None:
    """``"N {noun} hold NaN/inf after the update (a, b, c, ...)"`` for the tensors of ``named`` holding NaN/inf;
    None when all are finite."""
    bad = non_finite(named)
    if not bad:
        return None
    return f"{len(bad)} {noun} hold NaN/inf after the update ({name_list(bad)})"


__all__ = [
    "Divergence",
    "FloatMaster",
    "checked_backward",
    "learning_rate_hint",
    "master_step",
    "name_list",
    "non_finite",
    "non_finite_problem",
]
