"""`Context`: the one object every stage reads and writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.engine.progress import Tracker
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.recipes.schema import CALIBRATION_BATCH_SIZE, Recipe


@dataclass
class Context:
    recipe: Recipe
    model: nn.Module
    tokenizer: Any
    source: dict[str, Any]
    generator: torch.Generator
    calibration: torch.Tensor | None = None
    """Calibration token ids ``[samples, seq_len]`` (None when no stage needs calibration)."""
    params_before: dict[str, int] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    """Extra manifest entries stages add (e.g. replaced modules); saved with the model."""
    notes: list[str] = field(default_factory=list)
    """Warnings and facts for the report."""
    stage_report: dict[str, Any] = field(default_factory=dict)
    """What each stage wants in the report, by stage label."""
    tracker: Tracker = field(default_factory=Tracker)
    """Progress bars for long stages."""
    artifacts: dict[str, Callable[[Path], Any]] = field(default_factory=dict)
    """Extra outputs a stage leaves for the run folder: name -> writer of ``OUT/<name>/``."""
    block_start: dict[str, int] = field(default_factory=dict)
    """Parameters by part when the current top-level stage (or ``sequential`` block) started."""
    block_planned: int = 0
    """Parameters of the target's part the current block's fixed-budget stages plan to remove."""
    block_cache: dict[str, Any] = field(default_factory=dict)
    """Values a layer-scope stage computes once per block (e.g. prune_layer's solved fraction)."""
    checkpoints: Path | None = None
    """Where training stages keep checkpoints to resume from (beside the run's output; None: a run without one)."""

    # -- the one budget ------------------------------------------------------------------------
    def start_block(self, planned: int = 0) -> None:
        """Mark the start of a top-level stage or ``sequential`` block (the runner calls this)."""
        self.block_start = params_by_part(self.model)
        self.block_planned = planned
        self.block_cache = {}

    def _start(self) -> dict[str, int]:
        if not self.block_start:  # a stage called outside the runner: its block starts now
            self.start_block()
        return self.block_start

    def budget_left(self) -> int:
        """Parameters of the target's part still to remove when the current block started."""
        target = self.recipe.target
        return max(0, self._start()[target.part] - target.kept_limit(self.params_before))

    def params_to_remove(self) -> int:
        """What a ``solve`` stage removes: the budget left when its block started, minus what the
        block's fixed-budget stages plan to remove."""
        return max(0, self.budget_left() - self.block_planned)

    def layer_rule_ratio(self) -> float:
        """LoRAP's layer ratio (Appendix C.1), Ratio_l = left / (layers x Param_layer), with ``left`` the
        budget left when the block started (``Param_total x Ratio_s`` on a dense model) and Param_layer
        one layer's attention and MLP parameters at that time (averaged over the layers)."""
        target = self.recipe.target
        if target.of != "model":
            raise SlimkitError(f"ratio_rule: layer needs target.of: model (got {target.of})")
        start = self._start()
        layers = self.view.num_layers
        layer_params = (start["attention"] + start["mlp"]) // layers
        left = max(0.0, start["total"] - (1.0 - target.ratio) * self.params_before["total"])
        ratio = left / (layers * layer_params)
        if ratio >= 1.0:
            raise SlimkitError(
                f"ratio_rule: layer: the layers would have to lose {ratio:.1%} of their parameters to meet the target"
            )
        return ratio

    @property
    def view(self) -> ModelView:
        return ModelView(self.model)

    def report_stage(self, name: str, report: dict[str, Any]) -> str:
        """Store a stage's report under ``name``, or ``name#2``, ``name#3``, ... when an earlier stage of
        the recipe already reported under it (SP3's recipes fine-tune before and after the masks)."""
        key, n = name, 1
        while key in self.stage_report:
            n += 1
            key = f"{name}#{n}"
        self.stage_report[key] = report
        return key

    def calibration_batches(self) -> list[torch.Tensor]:
        if self.calibration is None:
            return []
        size = self.recipe.calibration.batch_size if self.recipe.calibration else CALIBRATION_BATCH_SIZE
        # On the CPU: every forward pass moves its batch to the model's input device (primitives/device/moves.py).
        return list(self.calibration.split(size))
