"""What a stage's memory estimate reads (:class:`MemoryInputs`) and the advice each kind of peak comes with.

A stage says its own peak beside the weights through :meth:`~slimkit.engine.stage_args.StageArgs.memory` (and,
inside a ``sequential`` block, :meth:`~slimkit.engine.stage_args.StageArgs.block_matrix_bytes`); the estimates
themselves are the arithmetic of :mod:`slimkit.primitives.device.memory_model`. :mod:`slimkit.engine.memory_check`
sums them into the recipe's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slimkit.primitives.device.memory_model import (
    FLOAT32,
    ModelShape,
    StageMemory,
    adamw_training_bytes,
    backward_activation_bytes,
    forward_activation_bytes,
    layer_activation_bytes,
)

if TYPE_CHECKING:
    from slimkit.recipes.schema import CalibrationConfig

GRADIENT_ADVICE = "lower calibration.batch_size or set stats_device: cpu"
ACTIVATION_ADVICE = "lower calibration.batch_size or set checkpoint_layers: true"
LAYERWISE_ADVICE = "lower calibration.samples or calibration.seq_len"
TRAINING_ADVICE = "lower the stage's batch_size or seq_len"
TASK_TRAINING_ADVICE = "lower the stage's batch_size or max_length"


@dataclass(frozen=True)
class MemoryInputs:
    """The model's shape (from its config), the recipe's calibration settings, the weights' bytes per value and
    the device the plan is for (None: not known; a stage then counts everything it may put there)."""

    shape: ModelShape
    calibration: CalibrationConfig | None
    dtype_bytes: int
    device: str | None = None

    @property
    def tokens(self) -> int:
        """Tokens of one calibration batch (0 without calibration)."""
        return self.calibration.batch_size * self.calibration.seq_len if self.calibration is not None else 0

    @property
    def samples(self) -> int:
        """Calibration samples (1 without calibration)."""
        return self.calibration.samples if self.calibration is not None else 1

    @property
    def seq_len(self) -> int:
        """Calibration sequence length (1 without calibration)."""
        return self.calibration.seq_len if self.calibration is not None else 1

    def log_prob_bytes(self, holdout_batches: int) -> int:
        """The float32 dense log-probabilities an allocation search keeps for its held-out batches (0 without)."""
        if not holdout_batches or self.calibration is None:
            return 0
        calibration = self.calibration
        return holdout_batches * calibration.batch_size * calibration.seq_len * self.shape.vocab * FLOAT32


def forward_memory(stage: str, inputs: MemoryInputs) -> StageMemory:
    """A stage that runs the calibration batches forward without gradients (one batch's activations)."""
    tokens = inputs.tokens
    parts = {"activations": forward_activation_bytes(inputs.shape, tokens, inputs.dtype_bytes)} if tokens else {}
    return StageMemory(stage, parts, ACTIVATION_ADVICE)


def training_memory(stage: str, inputs: MemoryInputs, batch_size: int | None, seq_len: int | None) -> StageMemory:
    """A stage that trains through the model: the backward's activations at its own batch (``batch_size`` x
    ``seq_len``), else at the calibration batch's."""
    tokens = batch_size * seq_len if batch_size is not None and seq_len is not None else inputs.tokens
    memory = StageMemory(stage, advice=TRAINING_ADVICE)
    memory.parts["activations"] = backward_activation_bytes(inputs.shape, tokens, inputs.dtype_bytes, False)
    return memory


def task_training_memory(
    stage: str, inputs: MemoryInputs, batch_size: int, max_length: int, trains_weights: bool
) -> StageMemory:
    """A stage that trains an encoder's task model: every layer's saved activations for ``batch_size`` examples of
    ``max_length`` tokens (a task head: no vocabulary logits) and, when the weights train, their gradients,
    float32 masters and AdamW moments."""
    memory = StageMemory(stage, advice=TASK_TRAINING_ADVICE)
    tokens = batch_size * max_length
    memory.parts["activations"] = inputs.shape.layers * layer_activation_bytes(inputs.shape, tokens, inputs.dtype_bytes)
    if trains_weights:
        memory.parts |= adamw_training_bytes(inputs.shape.total_params(), inputs.dtype_bytes)
    return memory


__all__ = [
    "ACTIVATION_ADVICE",
    "GRADIENT_ADVICE",
    "LAYERWISE_ADVICE",
    "TASK_TRAINING_ADVICE",
    "TRAINING_ADVICE",
    "MemoryInputs",
    "forward_memory",
    "task_training_memory",
    "training_memory",
]
