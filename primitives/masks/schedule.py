"""Multi-stage mask-training schedules (SP3 §3.2 "Multi-stage Pruning", Appendix D.2, Table 11).

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.mask_set import LEVELS


@dataclass(frozen=True)
class MaskStage:
    name: str
    epochs: float
    levels: frozenset[str]
    """Mask levels trained (and applied) in this stage; empty for plain fine-tuning."""


@dataclass(frozen=True)
class MaskSchedule:
    """Consecutive :class:`MaskStage`\\ s over ``steps_per_epoch`` optimiser steps per epoch."""

    stages: tuple[MaskStage, ...]
    steps_per_epoch: int
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1:
            raise SlimkitError(f"steps_per_epoch must be >= 1, got {self.steps_per_epoch}")
        if self.warmup_epochs < 0:
            raise SlimkitError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        for stage in self.stages:
            if stage.epochs < 0:
                raise SlimkitError(f"stage '{stage.name}' has negative epochs {stage.epochs}")
            unknown = set(stage.levels) - set(LEVELS)
            if unknown:
                raise SlimkitError(f"stage '{stage.name}': unknown mask levels {sorted(unknown)}; allowed: {LEVELS}")

    @classmethod
    def sp3(
        cls,
        steps_per_epoch: int,
        *,
        finetune_epochs: float = 2,
        dimension_epochs: float = 5,
        joint_epochs: float = 15,
        head: bool = True,
        layer: bool = True,
        warmup_epochs: float = 0.0,
    ) -> MaskSchedule:
        """Fine-tune → dimension masks → dimension + head + layer masks (each stage may be 0 epochs)."""
        joint = {"dimension"} | ({"head"} if head else set()) | ({"layer"} if layer else set())
        stages = (
            MaskStage("finetune", finetune_epochs, frozenset()),
            MaskStage("dimension", dimension_epochs, frozenset({"dimension"})),
            MaskStage("joint", joint_epochs, frozenset(joint)),
        )
        return cls(stages, steps_per_epoch, warmup_epochs)

    def _bounds(self) -> list[int]:
        """Cumulative end step of each stage."""
        out, end = [], 0.0
        for stage in self.stages:
            end += stage.epochs
            out.append(math.ceil(end * self.steps_per_epoch - 1e-9))
        return out

    @property
    def total_steps(self) -> int:
        return self._bounds()[-1] if self.stages else 0

    def stage_at(self, step: int) -> MaskStage | None:
        """The stage of global step ``step`` (0-based); ``None`` once every stage is over."""
        for stage, end in zip(self.stages, self._bounds(), strict=True):
            if step < end:
                return stage
        return None

    def levels(self, step: int) -> frozenset[str]:
        """Mask levels trainable at ``step`` (after the last stage: those of the last stage)."""
        stage = self.stage_at(step)
        if stage is None:
            return self.stages[-1].levels if self.stages else frozenset()
        return stage.levels

    def trainable(self, step: int, level: str) -> bool:
        return level in self.levels(step)

    def changed(self, step: int) -> bool:
        """True at the steps where the trainable levels differ from the previous step (and at step 0)."""
        return step == 0 or self.levels(step) != self.levels(step - 1)

    def pruning_start(self) -> int | None:
        """The first step at which some mask level is trainable (``None``: never)."""
        start = 0
        for stage, end in zip(self.stages, self._bounds(), strict=True):
            if stage.levels and end > start:
                return start
            start = end
        return None

    def target(self, step: int, final: float, start: float = 0.0) -> float:
        """Target sparsity at ``step``: ``final``, or the linear warm-up from ``start`` (see the module docstring)."""
        begin = self.pruning_start()
        if self.warmup_epochs <= 0 or begin is None:
            return float(final)
        warmup = self.warmup_epochs * self.steps_per_epoch
        progress = min(max((step - begin) / warmup, 0.0), 1.0)
        return float(start + (final - start) * progress)
