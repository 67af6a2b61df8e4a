"""Calibration: token batches from local corpora, activation statistics, layer-by-layer execution."""

from slimkit.primitives.calibration.batches import CalibrationSpec, calibration_batches
from slimkit.primitives.calibration.capture import (
    InputNormAccumulator,
    LayerInputs,
    capture_layer_inputs,
    input_norm_hooks,
    run_layer,
)

__all__ = [
    "CalibrationSpec",
    "InputNormAccumulator",
    "LayerInputs",
    "calibration_batches",
    "capture_layer_inputs",
    "input_norm_hooks",
    "run_layer",
]
