"""`Context`: what every stage reads of the run, and :class:`Block`, the recipe item running now."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.engine.progress import Tracker
from slimkit.primitives.arch import ModelView
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.recipes.schema import CALIBRATION_BATCH_SIZE, Recipe


@dataclass
class Block:
    """The top-level recipe item running now: its place in the recipe and the one budget when it started."""

    index: int = 0
    """Its position in the recipe's ``stages``."""
    label: str = ""
    """``0:prune``, ``1:sequential[lowrank,reconstruct]`` (the key of its timings and its share of the target)."""
    start: dict[str, int] = field(default_factory=dict)
    """Parameters by part when it started."""
    planned: int = 0
    """Parameters of the target's part its fixed-budget stages plan to remove."""


@dataclass
class Context:
    """What every stage reads of the run: the recipe, the model, the data, the generator, the budget; the notes and
    the progress it writes. A stage's own state and report are its own (:mod:`slimkit.engine.stage`)."""

    recipe: Recipe
    model: nn.Module
    tokenizer: Any
    source: dict[str, Any]
    generator: torch.Generator
    calibration: torch.Tensor | None = None
    """Calibration token ids ``[samples, seq_len]`` (None when no stage needs calibration)."""
    params_before: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Warnings and facts for the report."""
    tracker: Tracker = field(default_factory=Tracker)
    """Progress bars for long stages."""
    block: Block = field(default_factory=Block)
    """The top-level item running now (the runner starts one per item)."""
    checkpoints: Path | None = None
    """Where training stages keep checkpoints to resume from (beside the run's output; None: a run without one)."""

    # -- the one budget ------------------------------------------------------------------------
    def start_block(self, index: int = 0, label: str = "", planned: int = 0) -> None:
        """Mark the start of a top-level stage or ``sequential`` block (the runner calls this)."""
        self.block = Block(index, label, params_by_part(self.model), planned)

    def block_params(self) -> dict[str, int]:
        """Parameters by part when the current block started (a stage called outside the runner starts one now)."""
        if not self.block.start:
            self.start_block()
        return self.block.start

    def budget_left(self) -> int:
        """Parameters of the target's part still to remove when the current block started."""
        target = self.recipe.target
        return max(0, self.block_params()[target.part] - target.kept_limit(self.params_before))

    def params_to_remove(self) -> int:
        """What a ``solve`` stage removes: the budget left when its block started, minus what the
        block's fixed-budget stages plan to remove."""
        return max(0, self.budget_left() - self.block.planned)

    @property
    def view(self) -> ModelView:
        return ModelView(self.model)

    def calibration_batches(self) -> list[torch.Tensor]:
        if self.calibration is None:
            return []
        size = self.recipe.calibration.batch_size if self.recipe.calibration else CALIBRATION_BATCH_SIZE
        # On the CPU: every forward pass moves its batch to the model's input device (primitives/device/moves.py).
        return list(self.calibration.split(size))
