"""What a layer stage reads of its layer: :class:`LayerStats`, the statistics pass's typed result.

The layer-wise loop (:mod:`slimkit.engine.layerwise`) runs each layer on its calibration inputs with hooks and hands
every layer stage of the block one :class:`LayerStats`; the allocation pre-pass hands the same to the stages'
pre-passes. A field is None where the pass did not gather it (no calibration: nothing but ``block``; no stage that
reads consumer Grams: no ``dense_consumers``). The importance scorers of :mod:`slimkit.primitives.importance` read
statistics by name from a mapping (``stats["input_norms"]``) and memoise in it, so :class:`LayerStats` is also a
mapping: its set fields by their names, and whatever a scorer stores beside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from slimkit.primitives.calibration import LayerInputs
    from slimkit.primitives.reconstruct.consumer import DenseConsumer


@dataclass(frozen=True)
class BlockPosition:
    """Where a layer stage runs: how the block's layer inputs propagate (``compressed`` inside ``sequential``,
    ``dense`` for a layer stage at the top level) and the names of the block's stages before it."""

    propagate: Literal["dense", "compressed"]
    earlier: list[str]


@dataclass(eq=False)
class LayerStats(MutableMapping[str, Any]):
    """One layer's statistics, gathered before any stage of the block changes the layer."""

    input_norms: dict[str, torch.Tensor] | None = None
    """``||X_j||_2`` of every projection's input over the calibration tokens, by module path."""
    dense_consumers: dict[str, DenseConsumer] | None = None
    """By role (``down``, ``o``, or a low-rank role): the dense weight and its input Gram (with the cross terms of the
    dense stream for a ``target: dense`` refit), for the roles a stage of the block declared
    (:meth:`~slimkit.engine.stage_args.StageArgs.layer_grams`)."""
    tokens: int | None = None
    """Calibration tokens the statistics are over."""
    layer_inputs: LayerInputs | None = None
    """The layer's calibration inputs (hidden states and the layer's keyword arguments)."""
    block: BlockPosition | None = None
    """Where the stage runs (set by the layer-wise loop for each stage in turn)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What a scorer stores beside the statistics (its memo), by name."""

    def consumer(self, role: str) -> DenseConsumer:
        """The dense consumer of ``role`` captured by the block's statistics pass (a stage that reads one declares it
        in :meth:`~slimkit.engine.stage_args.StageArgs.layer_grams`)."""
        if self.dense_consumers is None or role not in self.dense_consumers:
            raise KeyError(f"no dense consumer statistics for role {role!r}: the stage did not declare it")
        return self.dense_consumers[role]

    def inputs(self) -> LayerInputs:
        """The layer's calibration inputs (set by the layer-wise loop before the block's stages run)."""
        if self.layer_inputs is None:
            raise KeyError("no layer inputs: the layer-wise loop sets them before the block's stages run")
        return self.layer_inputs

    def _typed(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if f.name != "extra")

    def __getitem__(self, key: str) -> Any:
        if key in self._typed():
            value = getattr(self, key)
            if value is None:
                raise KeyError(key)
            return dataclasses.asdict(value) if isinstance(value, BlockPosition) else value
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._typed():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._typed():
            if getattr(self, key) is None:
                raise KeyError(key)
            setattr(self, key, None)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from (key for key in self._typed() if getattr(self, key) is not None)
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)


__all__ = ["BlockPosition", "LayerStats"]
