"""`LowRankLinear`: a Linear replaced by two thinner Linears, ``y = L (R x) + b`` (LoRAP Eq. 3).

Two inner Linears, ``first`` (``R``) and ``second`` (``L``, with the original bias); no dense weight is
materialised.

Method note: docs/methods/lorap-awsvd.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from slimkit.primitives.lowrank.svd import DEFAULT_EPS, activation_weighted_svd, truncated_svd, whitened_svd

KIND = "low_rank"


class LowRankLinear(nn.Module):
    """``y = second(first(x)) = L (R x) + b``: a rank-``r`` stand-in for ``nn.Linear(d_in, d_out)``."""

    kind = KIND

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if min(in_features, out_features, rank) < 1:
            raise ValueError(
                f"in_features, out_features and rank must be >= 1, got {in_features}, {out_features}, {rank}"
            )
        self.first = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.second = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    # -- shape, read from the factors ----------------------------------------------------------
    @property
    def in_features(self) -> int:
        return int(self.first.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.second.weight.shape[0])

    @property
    def rank(self) -> int:
        return int(self.first.weight.shape[0])

    @property
    def bias(self) -> nn.Parameter | None:
        return self.second.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"bias={self.bias is not None}"
        )

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_factors(cls, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None) -> LowRankLinear:
        """The module computing ``x @ (L @ R)ᵀ + b``; dtype and device follow ``left``.

        ``left`` is ``L`` (``d_out x r``, becomes ``second.weight``), ``right`` is ``R`` (``r x d_in``,
        becomes ``first.weight``). The tensors are copied.
        """
        if left.dim() != 2 or right.dim() != 2 or left.shape[1] != right.shape[0]:
            raise ValueError(f"factors do not chain: L {tuple(left.shape)} @ R {tuple(right.shape)}")
        d_out, rank = left.shape
        d_in = right.shape[1]
        if bias is not None and bias.shape != (d_out,):
            raise ValueError(f"bias must have d_out={d_out} entries, got shape {tuple(bias.shape)}")
        module = cls(d_in, d_out, rank, bias=bias is not None, device=left.device, dtype=left.dtype)
        with torch.no_grad():
            module.first.weight.copy_(right)
            module.second.weight.copy_(left)
            if bias is not None:
                module.second.bias.copy_(bias)
        return module

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int,
        input_norms: torch.Tensor | None = None,
        *,
        gram: torch.Tensor | None = None,
        eps: float = DEFAULT_EPS,
        compute_dtype: torch.dtype | None = torch.float64,
    ) -> LowRankLinear:
        """Factor ``linear`` at ``rank``: whitened SVD with the input Gram ``gram`` (SVD-LLM), AWSVD (Eqs. 5–7)
        with ``input_norms``, else SVD (Eq. 4). Give at most one of the two statistics.

        The bias is kept as is; ``requires_grad`` of the new factors follows ``linear.weight``.
        """
        weight = linear.weight
        if gram is not None and input_norms is not None:
            raise ValueError("give input_norms (AWSVD) or gram (whitened SVD), not both")
        if gram is not None:
            left, right = whitened_svd(weight, gram, rank)
        elif input_norms is None:
            left, right = truncated_svd(weight, rank, compute_dtype=compute_dtype)
        else:
            left, right = activation_weighted_svd(weight, input_norms, rank, eps=eps, compute_dtype=compute_dtype)
        module = cls.from_factors(left, right, None if linear.bias is None else linear.bias.detach())
        module.requires_grad_(weight.requires_grad)
        return module

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` with weight ``L @ R`` (computed in float64) and the same bias."""
        weight = self.second.weight
        dense = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            dense.weight.copy_((weight.double() @ self.first.weight.double()).to(weight.dtype))
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    # -- manifest --------------------------------------------------------------------------------
    def manifest_entry(self, path: str) -> dict[str, Any]:
        """The record a loader needs to rebuild this module at ``path`` before loading weights.

        ``{"path", "kind": "low_rank", "rank", "in_features", "out_features", "bias"}``; the weights
        are under ``<path>.first.weight``, ``<path>.second.weight`` and (if ``bias``) ``<path>.second.bias``.
        """
        return {
            "path": path,
            "kind": KIND,
            "rank": self.rank,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
        }

    @classmethod
    def from_manifest_entry(
        cls, entry: dict[str, Any], device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LowRankLinear:
        """An (initialised, not loaded) module of the shapes recorded by :meth:`manifest_entry`."""
        if entry.get("kind") != KIND:
            raise ValueError(f"not a low-rank manifest entry (kind {entry.get('kind')!r}): {entry}")
        missing = [k for k in ("rank", "in_features", "out_features") if k not in entry]
        if missing:
            raise ValueError(f"low-rank manifest entry lacks {missing}: {entry}")
        return cls(
            int(entry["in_features"]),
            int(entry["out_features"]),
            int(entry["rank"]),
            bias=bool(entry.get("bias", False)),
            device=device,
            dtype=dtype,
        )


# -- whole-model helpers -------------------------------------------------------------------------
def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def lowrank_entries(model: nn.Module) -> list[dict[str, Any]]:
    """Manifest records of every :class:`LowRankLinear` in ``model``, in module order."""
    return [m.manifest_entry(name) for name, m in model.named_modules() if isinstance(m, LowRankLinear)]


def materialise_lowrank(model: nn.Module, entries: Iterable[dict[str, Any]]) -> int:
    """Replace the module at each low-rank entry's ``path`` by an empty :class:`LowRankLinear`.

    Entries of other kinds are skipped (the manifest's ``modules`` list may hold other records).
    The new module takes the replaced module's device and dtype. Returns how many were replaced.
    Call it on a freshly built model before ``load_state_dict``.
    """
    count = 0
    for entry in entries:
        if entry.get("kind") != KIND:
            continue
        old = model.get_submodule(entry["path"])
        reference = next(iter(old.parameters()), None)
        device = None if reference is None else reference.device
        dtype = None if reference is None else reference.dtype
        _set_submodule(model, entry["path"], LowRankLinear.from_manifest_entry(entry, device=device, dtype=dtype))
        count += 1
    return count


def member_target(module: nn.Module, param: str, dim: int) -> tuple[str, str]:
    """Where a Linear's ``param`` (``weight``/``bias``) along ``dim`` lives inside ``module``.

    For an ``nn.Linear`` (or anything else) it is ``("", param)``. For a :class:`LowRankLinear` the
    output dimension (``weight`` dim 0, ``bias``) is ``second``'s and the input dimension (``weight``
    dim 1) is ``first``'s: ``("second", "weight")``, ``("second", "bias")``, ``("first", "weight")``.
    Join the sub-path to the module path with a dot when it is not empty.
    """
    if not isinstance(module, LowRankLinear):
        return "", param
    if param == "bias":
        return "second", "bias"
    if param != "weight" or dim not in (0, 1, -1, -2):
        raise ValueError(f"a LowRankLinear has no {param!r} along dim {dim}")
    return ("second", "weight") if dim in (0, -2) else ("first", "weight")


__all__ = ["KIND", "LowRankLinear", "lowrank_entries", "materialise_lowrank", "member_target"]
