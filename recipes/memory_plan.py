"""A recipe's memory plan before any compute: each stage's peak beside the weights, summed into one plan.

:func:`recipe_memory_plan` reads the model's ``config.json`` (no weight loaded) and the recipe's calibration
settings, and estimates every stage with :mod:`slimkit.primitives.memory_plan`; :func:`check_memory_plan`
(the runner's preflight, called before the weights are loaded) refuses in one line when the plan's peak
exceeds the device's memory or ``model.max_memory``, naming the parts and what to lower::

    error: prune needs about 46.0 GiB on cuda:0 (weights 15.0, gradient sums 26.1, activations 3.2) and
    cuda:0 has 30.0 GiB; lower calibration.batch_size or set stats_device: cpu

A ``max_memory`` below the weights is the offload budget, not refused here: accelerate offloads the layers
that do not fit, layer-wise stages hold one layer at a time, and the runner refuses whole-model stages on
an offloaded model with its own message. :func:`memory_errors` turns an out-of-memory
error that still happens inside a stage (``torch.OutOfMemoryError``, CPU ``MemoryError``) into one
:class:`SlimkitError` naming the stage, with the same advice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.memory_plan import (
    FLOAT32,
    FLOAT64,
    MemoryPlan,
    ModelShape,
    StageMemory,
    backward_activation_bytes,
    forward_activation_bytes,
    gradient_sum_bytes,
    layer_input_bytes,
    weights_bytes,
)
from slimkit.recipes.schema import CalibrationConfig, Recipe, SequentialSpec, StageSpec

GRADIENT_ADVICE = "lower calibration.batch_size or set stats_device: cpu"
ACTIVATION_ADVICE = "lower calibration.batch_size or set checkpoint_layers: true"
LAYERWISE_ADVICE = "lower calibration.samples or calibration.seq_len"
TRAINING_ADVICE = "lower the stage's batch_size or seq_len"


def _scored_params(shape: ModelShape, kinds: list[str], layers: int) -> int:
    """Parameters whose gradients a scorer of these group kinds reads, over ``layers`` eligible layers."""
    if "hidden_feature" in kinds:
        return shape.total_params()
    per_layer = 0
    if {"attention_head", "kv_group"} & set(kinds):
        per_layer += shape.attention_params()
    if "mlp_channel" in kinds:
        per_layer += shape.mlp_params()
    return per_layer * layers


def _scorer_names(args: Any) -> set[str]:
    from slimkit.primitives.importance.compose import spec_names

    return set(spec_names(args.scorer_spec()))


def _gradient_stage(name: str, args: Any, shape: ModelShape, tokens: int, dtype_bytes: int, kinds: list[str]):
    """prune / cce with a gradient scorer: sums (or per-batch gradients), backward activations, one gradient."""
    layers = shape.layers - getattr(args, "skip_first", 0) - getattr(args, "skip_last", 0)
    params = _scored_params(shape, kinds, max(layers, 0))
    checkpoint_layers = getattr(args, "checkpoint_layers", False)
    memory = StageMemory(name, advice=GRADIENT_ADVICE)
    if name == "cce" and getattr(args, "gradients", "full") == "lora":
        linears = 4 * (shape.hidden + shape.q_width) + 3 * (shape.hidden + shape.intermediate)
        memory.parts["adapters"] = shape.layers * args.lora_rank * linears * FLOAT32 * 4  # weights, grads, AdamW
        memory.advice = ACTIVATION_ADVICE
    elif name == "cce":
        memory.parts["gradients"] = params * dtype_bytes  # one batch's gradient of every scored weight
    else:
        squares = "taylor" in _scorer_names(args) and getattr(args, "order", "first") != "first"
        sums = gradient_sum_bytes(params, squares)
        if getattr(args, "stats_device", "model") == "cpu":
            memory.host_parts["gradient sums"] = sums
            memory.advice = ACTIVATION_ADVICE
        else:
            memory.parts["gradient sums"] = sums
        largest = shape.embedding_params() if "hidden_feature" in kinds else shape.mlp_params() // 3
        memory.parts["one gradient"] = largest * dtype_bytes  # the largest scored weight's, before it is folded in
    memory.parts["activations"] = backward_activation_bytes(shape, tokens, dtype_bytes, checkpoint_layers)
    return memory


def stage_memory(
    spec: StageSpec, shape: ModelShape, calibration: CalibrationConfig | None, dtype_bytes: int
) -> StageMemory:
    """One top-level stage's peak beside the weights (see :mod:`slimkit.primitives.memory_plan`)."""
    args = spec.parsed_args()
    name = spec.stage
    tokens = (calibration.batch_size * calibration.seq_len) if calibration is not None else 0
    if name in ("prune", "cce") and hasattr(args, "needs") and "gradients" in args.needs():
        kinds = list(getattr(args, "groups", None) or getattr(args, "kinds", None) or [])
        return _gradient_stage(name, args, shape, tokens, dtype_bytes, kinds)
    if name in ("prune", "cce"):
        parts = {"activations": forward_activation_bytes(shape, tokens, dtype_bytes)} if tokens else {}
        return StageMemory(name, parts, ACTIVATION_ADVICE)
    if name in ("lora", "distill", "mask_train", "prunenet"):
        own = (
            getattr(args, "micro_batch_size", None) or getattr(args, "batch_size", None),
            getattr(args, "seq_len", None),
        )
        train_tokens = own[0] * own[1] if None not in own else tokens
        memory = StageMemory(name, advice=TRAINING_ADVICE)
        memory.parts["activations"] = backward_activation_bytes(shape, train_tokens, dtype_bytes, False)
        if name in ("lora", "distill"):
            linears = 4 * (shape.hidden + shape.q_width) + 3 * (shape.hidden + shape.intermediate)
            # float32 adapters, their gradients, AdamW's two moments and the last good copy
            memory.parts["adapters"] = shape.layers * args.rank * linears * FLOAT32 * 5
        if name == "distill":  # counted even for a cached top_k teacher, which may need loading on a cache miss
            memory.parts["teacher"] = weights_bytes(shape, dtype_bytes)
            memory.parts["logits"] = 2 * train_tokens * shape.vocab * dtype_bytes  # the student's and the teacher's
        return memory
    if name == "remove_blocks":  # the inputs of every layer, kept for the search (primitives/blocks/search.py)
        batches = getattr(args, "batches", None)
        samples = calibration.samples if calibration is not None else 1
        if batches is not None and calibration is not None:
            samples = min(samples, batches * calibration.batch_size)
        seq_len = calibration.seq_len if calibration is not None else 1
        memory = StageMemory(name, advice=f"{LAYERWISE_ADVICE}, or set remove_blocks' batches")
        memory.parts["layer inputs"] = (shape.layers + 1) * layer_input_bytes(shape, samples, seq_len, dtype_bytes) // 2
        memory.parts["activations"] = forward_activation_bytes(shape, tokens, dtype_bytes)
        return memory
    if name in ("pca_project", "pca_project_post"):
        samples = calibration.samples if calibration is not None else 1
        seq_len = calibration.seq_len if calibration is not None else 1
        memory = StageMemory(name, advice=LAYERWISE_ADVICE)
        memory.parts["layer inputs"] = layer_input_bytes(shape, samples, seq_len, dtype_bytes)
        memory.parts["matrices"] = 3 * shape.hidden * shape.hidden * FLOAT32  # covariance, eigenvectors, rotation
        return memory
    memory = StageMemory(name, advice=ACTIVATION_ADVICE)
    held = search_log_prob_bytes(spec, shape, calibration)
    if held:
        memory.parts["dense log-probs"] = held
    return memory


def block_memory(
    spec: SequentialSpec, shape: ModelShape, calibration: CalibrationConfig | None, dtype_bytes: int
) -> StageMemory:
    """A ``sequential`` block: one layer's inputs/outputs for every sample and one layer's matrices."""
    samples = calibration.samples if calibration is not None else 1
    seq_len = calibration.seq_len if calibration is not None else 1
    name = f"sequential[{','.join(s.stage for s in spec.sequential)}]"
    memory = StageMemory(name, advice=LAYERWISE_ADVICE)
    memory.parts["layer inputs"] = layer_input_bytes(shape, samples, seq_len, dtype_bytes)
    widest = max(shape.hidden, shape.intermediate)
    matrices = 0
    for child in spec.sequential:
        if child.stage in ("reconstruct", "obs_prune_layer"):
            # The consumer's float64 input Gram, its kept block, the damped copy, the Cholesky factor and the
            # solve's temporaries: about five d x d float64 matrices at once (measured at 8B on a GPU: reconstruct
            # added 7.9-8.5 GiB beside the weights, d = 14,336; this term says 7.7)
            matrices = max(matrices, 5 * widest * widest * FLOAT64)
        elif child.stage == "lowrank":
            matrices = max(matrices, 3 * shape.hidden * shape.intermediate * FLOAT32)  # one SVD in float32
    if matrices:
        memory.parts["matrices"] = matrices
    held = max(search_log_prob_bytes(child, shape, calibration) for child in spec.sequential)
    if held:
        memory.parts["dense log-probs"] = held
    return memory


def search_log_prob_bytes(spec: StageSpec, shape: ModelShape, calibration: CalibrationConfig | None) -> int:
    """The float32 dense log-probabilities an allocation search keeps for its held-out batches (0 without one)."""
    holdout = getattr(spec.parsed_args(), "holdout_batches", lambda: 0)()
    if not holdout or calibration is None:
        return 0
    return holdout * calibration.batch_size * calibration.seq_len * shape.vocab * FLOAT32


def recipe_memory_plan(recipe: Recipe, config: Any, dtype: torch.dtype) -> MemoryPlan:
    """The plan of ``recipe`` on a model of ``config`` (a transformers config) in ``dtype``."""
    shape = ModelShape.from_config(config)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    calibration = recipe.calibration_config()
    stages = [
        block_memory(item, shape, calibration, dtype_bytes)
        if isinstance(item, SequentialSpec)
        else stage_memory(item, shape, calibration, dtype_bytes)
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
    plan = recipe_memory_plan(recipe, config, placement.dtype)
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
    from slimkit.primitives.sources import resolve_source

    folder, _info = resolve_source(recipe.model.source)
    return folder_config(folder)  # checks the folder as slimkit.load does


OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)


@contextlib.contextmanager
def memory_errors(label: str) -> Iterator[None]:
    """Turn an out-of-memory error inside ``label`` (a stage, or load / calibration / save) into one line."""
    try:
        yield
    except OOM_ERRORS as error:
        where = "GPU" if isinstance(error, torch.OutOfMemoryError) else "host"
        raise SlimkitError(
            f"{label} ran out of {where} memory; {GRADIENT_ADVICE}, {ACTIVATION_ADVICE.split(' or ')[-1]}, "
            "or a smaller model.max_memory to offload layers (layer-wise stages)"
        ) from None


__all__ = [
    "block_memory",
    "check_memory_plan",
    "device_memory",
    "memory_errors",
    "recipe_memory_plan",
    "stage_memory",
]
