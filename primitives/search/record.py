"""One computed candidate: :class:`CandidateRecord`, what a library entry holds and what applying it needs.

A record is the replacement of one sub-block of one layer: its spec, the structure that reshapes the parent
(``kept`` unit indices, or low-rank ``ranks`` per projection), the sub-block's tensors after the refit (keys relative
to the layer module), and its costs (parameters removed by part, bytes removed, the KV heads it keeps). Records are
written to and read from the library's store (:mod:`.store`) as one safetensors file each, the rest as JSON metadata.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from slimkit.primitives.search.candidates import CandidateSpec


@dataclass
class CandidateRecord:
    """A computed candidate (see the module docstring)."""

    layer: int
    spec: CandidateSpec
    structure: dict[str, Any] = field(default_factory=dict)
    """``{"kept": [...]}`` (unit indices into the parent's units), ``{"ranks": {role: rank}}`` or ``{}``."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The sub-block's parameters and buffers after the change, by name relative to the layer module."""
    removed: dict[str, int] = field(default_factory=dict)
    """Parameters removed, by part of ``params_by_part`` (``total``, ``layers``, ``attention``, ``mlp``, ``norms``)."""
    removed_bytes: int = 0
    """Bytes of weights removed (at the weights' own dtypes)."""
    kv_heads: int = 0
    """KV heads the layer's attention keeps with this candidate (the parent's for an MLP candidate)."""
    head_dim: int = 0
    seconds: float = 0.0
    """What computing it took (0 when read from the store)."""

    def metadata(self) -> str:
        """Everything but the tensors, as JSON."""
        return json.dumps(
            {
                "layer": self.layer,
                "part": self.spec.part,
                "name": self.spec.name,
                "structure": self.structure,
                "removed": self.removed,
                "removed_bytes": self.removed_bytes,
                "kv_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "seconds": self.seconds,
            },
            sort_keys=True,
        )

    @classmethod
    def from_metadata(cls, text: str, tensors: dict[str, torch.Tensor]) -> CandidateRecord:
        """The record :meth:`metadata` wrote, with its tensors."""
        data = json.loads(text)
        return cls(
            layer=int(data["layer"]),
            spec=CandidateSpec.parse(data["part"], data["name"]),
            structure=dict(data["structure"]),
            tensors=tensors,
            removed={str(k): int(v) for k, v in data["removed"].items()},
            removed_bytes=int(data["removed_bytes"]),
            kv_heads=int(data["kv_heads"]),
            head_dim=int(data["head_dim"]),
            seconds=float(data["seconds"]),
        )


__all__ = ["CandidateRecord"]
