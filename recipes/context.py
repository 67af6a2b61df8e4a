"""`Context`: the one object every stage reads and writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.recipes.progress import Tracker
from slimkit.recipes.schema import Recipe


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
        size = self.recipe.calibration.batch_size if self.recipe.calibration else 8
        return list(self.calibration.split(size))
