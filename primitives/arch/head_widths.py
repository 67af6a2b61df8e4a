"""Per-head widths: a self-attention whose heads keep their own q/k and v/o widths (SP3 Eq. 15 after the masks).

Method note: docs/methods/sp3-attention-drone.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from slimkit.primitives.arch.spec import ArchSpec
from slimkit.primitives.errors import SlimkitError

KIND = "head_widths"
"""The manifest ``modules`` kind of a :class:`HeadWidthAttention`."""


@dataclass(frozen=True)
class HeadWidths:
    """The kept widths of every head of one layer: ``qk[h]`` query/key dimensions, ``vo[h]`` value/output ones."""

    qk: tuple[int, ...]
    vo: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.qk) != len(self.vo) or not self.qk:
            raise SlimkitError(f"per-head widths need one q/k and one v/o width per head, got {self.qk}, {self.vo}")
        if any(type(w) is not int or w < 0 for w in (*self.qk, *self.vo)):
            raise SlimkitError(f"per-head widths must be non-negative integers, got {self.qk}, {self.vo}")

    @property
    def num_heads(self) -> int:
        return len(self.qk)


def head_width_refusal(spec: ArchSpec) -> str | None:
    """None when ``spec``'s heads can keep their own q/k and v/o widths, else why not (one phrase)."""
    if spec.rope:
        return f"{spec.model_type} rotates q and k by position between the projection and the dot product (RoPE)"
    if spec.qk_norms:
        return f"{spec.model_type} normalises q and k per head (q_norm/k_norm) after the projection"
    if not spec.encoder:
        return f"{spec.model_type} is a decoder, whose KV cache and attention kernels need heads of one width"
    return None


def _relative(spec: ArchSpec, role: str) -> str:
    path = getattr(spec, role)
    prefix = spec.attention + "."
    if not path.startswith(prefix):
        raise SlimkitError(f"{spec.model_type}: the {role} projection ({path}) is not inside {spec.attention}")
    return path[len(prefix) :]


def _packed_positions(widths: Sequence[int], width: int) -> torch.Tensor:
    """Positions of the packed rows inside ``[heads * width]`` (head ``h``'s rows start at ``h * width``)."""
    return torch.cat([h * width + torch.arange(w) for h, w in enumerate(widths)]).long()


class HeadWidthAttention(nn.Module):
    """Self-attention with per-head q/k and v/o widths (see the module docstring); returns ``(output, None)``.

    ``names`` maps ``q``, ``k``, ``v`` to the projections' attribute names (the architecture's, e.g. ``query``), so
    the model's paths to them stay as they were.
    """

    def __init__(
        self,
        projections: Mapping[str, nn.Linear],
        names: Mapping[str, str],
        widths: HeadWidths,
        head_size: int,
        head_size_attr: str,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.names = dict(names)
        for role in ("q", "k", "v"):
            self.add_module(self.names[role], projections[role])
        self.widths = widths
        self.head_size = head_size
        self.head_size_attr = head_size_attr
        setattr(self, head_size_attr, head_size)  # what ModelView reads as the layer's head_dim
        self.dropout = dropout
        self.scaling = head_size**-0.5
        self.qk_width, self.vo_width = max(max(widths.qk), 1), max(max(widths.vo), 1)
        self.qk_positions = _packed_positions(widths.qk, self.qk_width)
        self.vo_positions = _packed_positions(widths.vo, self.vo_width)

    def projection(self, role: str) -> nn.Linear:
        return getattr(self, self.names[role])

    @property
    def num_heads(self) -> int:
        return self.widths.num_heads

    def check(self) -> None:
        """The projections' rows equal the widths (q and k: ``sum(qk)``, v: ``sum(vo)``)."""
        expected = {"q": sum(self.widths.qk), "k": sum(self.widths.qk), "v": sum(self.widths.vo)}
        for role, rows in expected.items():
            have = int(self.projection(role).weight.shape[0])
            if have != rows:
                raise SlimkitError(
                    f"per-head widths {list(self.widths.qk)} (q/k) and {list(self.widths.vo)} (v/o) need {rows} "
                    f"{role} rows, the projection has {have}"
                )

    def _heads(self, packed: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """``[batch, tokens, packed]`` -> ``[batch, heads, tokens, width]``, zero-padded per head."""
        batch, tokens = packed.shape[:2]
        out = packed.new_zeros(batch, tokens, self.num_heads * width)
        out[..., positions.to(packed.device)] = packed
        return out.view(batch, tokens, self.num_heads, width).transpose(1, 2)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        if kwargs.get("past_key_values") is not None:
            raise SlimkitError("an attention with per-head widths keeps no KV cache (it is for encoders)")
        q = self._heads(self.projection("q")(hidden_states), self.qk_positions, self.qk_width)
        k = self._heads(self.projection("k")(hidden_states), self.qk_positions, self.qk_width)
        v = self._heads(self.projection("v")(hidden_states), self.vo_positions, self.vo_width)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scaling,
        )
        batch, tokens = hidden_states.shape[:2]
        out = out.transpose(1, 2).reshape(batch, tokens, self.num_heads * self.vo_width)
        return out[..., self.vo_positions.to(out.device)], None

    def extra_repr(self) -> str:
        return f"qk_widths={list(self.widths.qk)}, vo_widths={list(self.widths.vo)}, head_size={self.head_size}"


def _dropout_of(attention: nn.Module) -> float:
    dropout = getattr(attention, "dropout", None)
    if isinstance(dropout, nn.Dropout):
        return float(dropout.p)
    return float(dropout) if isinstance(dropout, (int, float)) else 0.0


def with_head_widths(
    spec: ArchSpec, attention: nn.Module, widths: HeadWidths, projections: Mapping[str, nn.Linear] | None = None
) -> HeadWidthAttention:
    """A :class:`HeadWidthAttention` standing in for ``attention`` (the architecture's module or an earlier
    :class:`HeadWidthAttention`), using ``projections`` (default: ``attention``'s own q, k and v)."""
    reason = head_width_refusal(spec)
    if reason is not None:
        raise SlimkitError(f"heads cannot keep their own widths here: {reason}")
    names = {role: _relative(spec, role) for role in ("q", "k", "v")}
    if projections is None:
        projections = {role: attention.get_submodule(names[role]) for role in ("q", "k", "v")}
    head_size = int(getattr(attention, spec.head_dim_attr))
    new = HeadWidthAttention(projections, names, widths, head_size, spec.head_dim_attr, _dropout_of(attention))
    return new.train(attention.training)


def head_width_entries(model: nn.Module) -> list[dict[str, Any]]:
    """Manifest records of every :class:`HeadWidthAttention`, in module order."""
    return [
        {
            "path": name,
            "kind": KIND,
            "head_size": module.head_size,
            "qk_widths": list(module.widths.qk),
            "vo_widths": list(module.widths.vo),
            "dropout": module.dropout,
        }
        for name, module in model.named_modules()
        if isinstance(module, HeadWidthAttention)
    ]


def _entry_widths(entry: Mapping[str, Any], where: str) -> HeadWidths:
    lists = [entry.get(key) for key in ("qk_widths", "vo_widths")]
    if not all(isinstance(w, list) and all(type(x) is int for x in w) for w in lists):
        raise SlimkitError(f"{where} needs qk_widths and vo_widths as lists of integers")
    if entry.get("head_size") is not None and any(x > entry["head_size"] for w in lists for x in w):
        raise SlimkitError(f"{where}: a head width is larger than head_size {entry['head_size']}")
    try:
        return HeadWidths(tuple(lists[0]), tuple(lists[1]))
    except SlimkitError as error:
        raise SlimkitError(f"{where}: {error}") from None


def materialise_head_widths(
    model: nn.Module, spec: ArchSpec, entries: Iterable[Mapping[str, Any]], saved: Mapping[str, tuple[int, ...]]
) -> int:
    """Put a :class:`HeadWidthAttention` at each ``head_widths`` entry's path, with projections of the saved shapes
    (before the weights load); an entry whose widths disagree with the saved shapes raises one line."""
    count = 0
    for index, entry in enumerate(entries):
        if entry.get("kind") != KIND:
            continue
        path = str(entry["path"])
        where = f"modules[{index}] ({KIND} at {path})"
        widths = _entry_widths(entry, where)
        old = model.get_submodule(path)
        if int(getattr(old, spec.head_dim_attr, -1)) != entry.get("head_size"):
            raise SlimkitError(
                f"{where}: head_size {entry.get('head_size')} is not the model's head size "
                f"{getattr(old, spec.head_dim_attr, None)}"
            )
        names = {role: _relative(spec, role) for role in ("q", "k", "v")}
        rows = {"q": sum(widths.qk), "k": sum(widths.qk), "v": sum(widths.vo)}
        projections = {}
        for role, name in names.items():
            shape = saved.get(f"{path}.{name}.weight")
            if shape is None or len(shape) != 2 or shape[0] != rows[role]:
                raise SlimkitError(
                    f"{where}: the widths need {rows[role]} rows in {path}.{name}.weight, the weights hold "
                    f"{list(shape) if shape is not None else 'none'}"
                )
            projections[role] = nn.Linear(shape[1], shape[0], bias=f"{path}.{name}.bias" in saved)
        new = with_head_widths(spec, old, widths, projections)
        new.dropout = float(entry.get("dropout") or 0.0)
        model.set_submodule(path, new)
        count += 1
    return count


__all__ = [
    "KIND",
    "HeadWidthAttention",
    "HeadWidths",
    "head_width_entries",
    "head_width_refusal",
    "materialise_head_widths",
    "with_head_widths",
]
