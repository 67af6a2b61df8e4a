"""A recipe's memory plan before any compute: each stage's peak beside the weights, summed into one plan, and the
one-line refusal when it exceeds the device's memory or ``model.max_memory``.

Method note: docs/methods/devices-offload.md.
"""

from __future__ import annotations

from typing import Any

import torch

from slimkit.engine.capabilities import PlansMemory, memory_of
from slimkit.engine.stage_memory import LAYERWISE_ADVICE, MemoryInputs
from slimkit.primitives.device.memory_model import (
    MemoryPlan,
    ModelShape,
    StageMemory,
    layer_input_bytes,
    weights_bytes,
)
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.schema import CalibrationConfig, Recipe, SequentialSpec, StageSpec
from slimkit.recipes.stage_args import ReadsData, offered


def stage_memory(
    spec: StageSpec,
    shape: ModelShape,
    calibration: CalibrationConfig | None,
    dtype_bytes: int,
    device: str | None = None,
) -> StageMemory:
    """One top-level stage's peak beside the weights: the stage's own estimate (:meth:`PlansMemory.memory`)."""
    return memory_of(spec.parsed_args(), spec.stage, MemoryInputs(shape, calibration, dtype_bytes, device))


def block_memory(
    spec: SequentialSpec, shape: ModelShape, calibration: CalibrationConfig | None, dtype_bytes: int
) -> StageMemory:
    """A ``sequential`` block: one layer's inputs/outputs for every sample and one layer's matrices (the largest
    a stage of the block holds, :meth:`PlansMemory.block_matrix_bytes`)."""
    inputs = MemoryInputs(shape, calibration, dtype_bytes)
    name = f"sequential[{','.join(s.stage for s in spec.sequential)}]"
    memory = StageMemory(name, advice=LAYERWISE_ADVICE)
    memory.parts["layer inputs"] = layer_input_bytes(shape, inputs.samples, inputs.seq_len, dtype_bytes)
    matrices = max(offered(child.parsed_args(), PlansMemory).block_matrix_bytes(shape) for child in spec.sequential)
    if matrices:
        memory.parts["matrices"] = matrices
    held = max(
        inputs.log_prob_bytes(offered(child.parsed_args(), ReadsData).holdout_batches()) for child in spec.sequential
    )
    if held:
        memory.parts["dense log-probs"] = held
    return memory


def search_log_prob_bytes(spec: StageSpec, shape: ModelShape, calibration: CalibrationConfig | None) -> int:
    """The float32 dense log-probabilities an allocation search keeps for its held-out batches (0 without one)."""
    return MemoryInputs(shape, calibration, 0).log_prob_bytes(offered(spec.parsed_args(), ReadsData).holdout_batches())


def recipe_memory_plan(
    recipe: Recipe, config: Any, dtype: torch.dtype, device: torch.device | None = None
) -> MemoryPlan:
    """The plan of ``recipe`` on a model of ``config`` (a transformers config) in ``dtype`` on ``device`` (None: not
    known)."""
    shape = ModelShape.from_config(config)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    calibration = recipe.calibration_config()
    stages = [
        block_memory(item, shape, calibration, dtype_bytes)
        if isinstance(item, SequentialSpec)
        else stage_memory(item, shape, calibration, dtype_bytes, str(device) if device is not None else None)
        for item in recipe.stages
    ]
    return MemoryPlan(weights_bytes(shape, dtype_bytes), stages)


def device_memory(device: torch.device) -> int:
    """Bytes a run may use on ``device``: a GPU's free memory, the machine's total RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().total


def check_memory_plan(recipe: Recipe, placement: Any, model: Any = None) -> MemoryPlan | None:
    """The runner's preflight: the plan, or one ``SlimkitError`` line when it does not fit the device or the
    ``max_memory`` budget. None when the model's config is not a decoder LM's (no plan is made)."""
    config = getattr(model, "config", None) if model is not None else _source_config(recipe)
    if config is None or not all(hasattr(config, k) for k in ("hidden_size", "intermediate_size", "vocab_size")):
        return None
    plan = recipe_memory_plan(recipe, config, placement.dtype, placement.device)
    budget = placement.max_memory
    if budget is not None and budget < plan.weights:
        return plan  # offloaded: layer-wise stages hold one layer at a time; the runner refuses whole-model ones
    available = device_memory(placement.device) if budget is None else budget
    where = str(placement.device) if budget is None else f"{placement.device} (max_memory)"
    if placement.gpus and budget is None:  # layers spread over several GPUs: their memory together
        available = sum(device_memory(torch.device("cuda", index)) for index in placement.gpus)
        where = f"{len(placement.gpus)} GPUs together"
    message = plan.refusal(where, available)
    if message is not None:
        raise SlimkitError(message)
    return plan


def _source_config(recipe: Recipe) -> Any:
    from slimkit.primitives.io.load import folder_config
    from slimkit.primitives.io.model_sources import resolve_source

    folder, _info = resolve_source(recipe.model.source)
    return folder_config(folder)  # checks the folder as slimkit.load does


__all__ = [
    "block_memory",
    "check_memory_plan",
    "device_memory",
    "recipe_memory_plan",
    "stage_memory",
]
