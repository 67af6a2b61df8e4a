"""Checks a run makes before any compute: placement, dtypes, exports, calibration length, evaluation, data files.

Each raises :class:`~slimkit.primitives.errors.SlimkitError` with one line naming the field, what is wrong and what
is allowed; none changes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slimkit.engine.capabilities import ChecksModel, ChecksReach
from slimkit.engine.context import Block, Context
from slimkit.engine.dispatch import block_children, start_item
from slimkit.primitives.device.offload import check_stage_fits, is_offloaded
from slimkit.primitives.device.placement import DTYPES, Placement, resolve_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.glue_task_model import task_head
from slimkit.primitives.io.paths import check_path_length
from slimkit.recipes.catalogue import stage_def
from slimkit.recipes.schema import CalibrationConfig, Recipe, SequentialSpec
from slimkit.recipes.stage_args import ChangesProjections, ReadsData, offered


def preflight_calibration_data(calibration: CalibrationConfig | None) -> None:
    """Read the calibration data file now, so a missing one (or an unusable cache folder the datasets library
    writes to) fails before any compute."""
    from slimkit.primitives.calibration.batches import check_calibration_source

    if calibration is not None:
        check_calibration_source(calibration.dataset)


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def _unsaveable(data: Any) -> tuple[str, Any] | None:
    """The dotted path and value of the first thing in ``data`` that YAML's safe dumper and JSON cannot both
    write (numpy scalars, dates, sets, objects, non-string keys), or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if type(key) is not str:
                    return f"{path}.{key!r}".lstrip("."), key
                stack.append((f"{path}.{key}".lstrip("."), item))
        elif type(value) is list:
            stack.extend((f"{path}.{index}".lstrip("."), item) for index, item in enumerate(value))
        elif type(value) not in _PLAIN_SCALARS:
            return path, value
    return None


def check_recipe_saveable(recipe: Recipe) -> None:
    """The recipe's mapping is saved as ``recipe.yaml`` and in the manifest's JSON once the run is done: refuse,
    before any compute, a value neither can hold (a numpy scalar or a tuple from the Python API, a date)."""
    found = _unsaveable(recipe.source())
    if found is not None:
        path, value = found
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise SlimkitError(
            f"recipe {path or 'mapping'}: a {kind} ({str(value)[:40]}) cannot be saved in recipe.yaml; give plain "
            "values (str, int, float, bool, None, lists and mappings with string keys)"
        )


RUN_WRITES = (
    "model/model-00001-of-00099.safetensors",
    "model/model.safetensors.index.json",
    "model/special_tokens_map.json",
    "model/tokenizer_config.json",
    "model/generation_config.json",
    "model/slimkit_manifest.json",
    "report.json",
)
"""The longest paths a run writes inside its output folder (the model's shards and side files, the report)."""


def check_output_paths(recipe: Recipe, out: Path) -> None:
    """Refuse, before any compute, an output folder whose files (the model, the report, every ``export:`` item)
    would be longer paths than the file system takes (``PATH_MAX``, ``NAME_MAX``)."""
    exports = [
        item.target() + ("/" + RUN_WRITES[0].removeprefix("model/") if item.format == "hf" else "")
        for item in recipe.export
    ]
    check_path_length("--out", out, [*RUN_WRITES, *exports])


def model_placement(recipe: Recipe, model: Any = None) -> Placement:
    """Where the run computes: the recipe's ``model`` fields, or the given in-memory model's own device and
    dtype (a recipe that names another device or dtype for it is refused: nothing is moved silently)."""
    settings = recipe.model
    if model is None:
        return Placement.resolve(settings.device, settings.dtype, settings.max_memory)
    first = next(model.parameters())
    if settings.max_memory is not None:
        raise SlimkitError("model.max_memory applies when slimkit loads the model, not to a model given in memory")
    if settings.device != "auto":
        device = resolve_device(settings.device)
        if device != first.device and not device.type == first.device.type == "cuda":
            raise _given_model_differs("device", settings.device, first.device)
    if settings.dtype != "auto" and DTYPES[settings.dtype] != first.dtype:
        raise _given_model_differs("dtype", settings.dtype, first.dtype)
    return Placement(first.device, first.dtype)


def _given_model_differs(field: str, wanted: str, actual: object) -> SlimkitError:
    return SlimkitError(
        f"model.{field}: the recipe asks for {wanted} but the model given has {actual}; "
        f"move or cast the model first, or leave model.{field}: auto"
    )


def check_stage_dtypes(recipe: Recipe, dtype: torch.dtype) -> None:
    """Refuse stages that cannot run with the weights' dtype, before anything is loaded."""
    if dtype != torch.float16:
        return
    for spec in recipe.flat_stages():
        if stage_def(spec.stage).trains:
            raise SlimkitError(
                f"stage '{spec.stage}' trains through the model, which float16 weights cannot do without loss "
                "scaling (activations and gradients overflow or underflow); use model.dtype bfloat16 or float32"
            )


def check_export_model(recipe: Recipe, model: Any) -> None:
    """Refuse, before any compression, an ``export:`` item the model's type can never satisfy."""
    from slimkit.primitives.export import EXPORTABLE_MODEL_TYPES, HF_MODEL_TYPES

    model_type = getattr(model.config, "model_type", None)
    head = task_head(recipe.task)
    for index, item in enumerate(recipe.export):
        allowed = EXPORTABLE_MODEL_TYPES if item.format == "gguf" else HF_MODEL_TYPES
        if model_type not in allowed or head is not None:
            raise SlimkitError(
                f"export.{index}: format {item.format} writes {', '.join(allowed)} language models; "
                f"this run's model is {head.what if head is not None else repr(model_type)}"
            )


def check_stage_models(recipe: Recipe, model: Any) -> None:
    """Each stage's own refusals that need the loaded model (:meth:`ChecksModel.check_model`), and a training
    stage's windows (its ``seq_len``) within the model's positions, before calibration."""
    from slimkit.primitives.arch.moe import role_refusal

    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    for where, spec in recipe.stage_places():
        args = spec.parsed_args()
        seq_len = getattr(args, "seq_len", None)
        if isinstance(positions, int) and isinstance(seq_len, int) and seq_len > positions:
            raise SlimkitError(
                f"{where} ({spec.stage}): args.seq_len {seq_len} is longer than the model's max_position_embeddings "
                f"({positions}); use at most {positions}"
            )
        projections = offered(args, ChangesProjections)
        refusal = role_refusal(model, spec.stage, projections.touches() | projections.makes_lowrank())
        if refusal is not None:  # a MoE model's projections the stage would change
            raise SlimkitError(refusal)
        offered(args, ChecksModel).check_model(model)


def dense_reloaders(recipe: Recipe) -> list[str]:
    """The top-level stages that reload the dense model during the run (:meth:`ReadsData.reloads_dense`:
    ``distill`` with steps to train, its teacher; ``reconstruct``, its refit target), as ``stages.N (NAME)``."""
    return [
        f"stages.{index} ({item.stage})"
        for index, item in enumerate(recipe.stages)
        if not isinstance(item, SequentialSpec) and offered(item.parsed_args(), ReadsData).reloads_dense()
    ]


def check_dense_reachable(recipe: Recipe, source: dict[str, Any]) -> None:
    """Refuse, before any compute, a recipe that reloads the dense model when a slimkit output is compressed whose
    dense origin is not on this machine (``source["compressed_from"]``, from
    :func:`~slimkit.primitives.io.model_sources.dense_origin`), then each stage's own checks of the source
    (:meth:`ChecksModel.check_source`: a distillation hidden-state term after a PCA projection). A model given in
    memory is refused by the stage itself when it reloads."""
    reloaders = dense_reloaders(recipe)
    origin = source.get("compressed_from")
    if reloaders and origin is not None and origin.get("path") is None:
        raise SlimkitError(f"{reloaders[0]}: reloads the dense model, but {origin['missing']}")
    for spec in recipe.flat_stages():
        offered(spec.parsed_args(), ChecksModel).check_source(recipe, source)


def check_calibration_length(recipe: Recipe, model: Any) -> None:
    """Refuse, before calibrating, a ``calibration.seq_len`` longer than the model's positions
    (its config's ``max_position_embeddings``, when it has one)."""
    config = recipe.calibration_config()
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if config is None or not isinstance(limit, int) or config.seq_len <= limit:
        return
    raise SlimkitError(
        f"calibration.seq_len: {config.seq_len} is longer than the model's max_position_embeddings ({limit}); "
        f"use at most {limit}"
    )


def check_eval_model(recipe: Recipe, model: Any) -> None:
    """Refuse, before any compression, an evaluation the run's model cannot take
    (:func:`~slimkit.primitives.evaluate.run.check_eval_model`)."""
    from slimkit.primitives.evaluate.run import check_eval_model as check_evaluations

    check_evaluations(recipe.eval, model, task_head(recipe.task) is not None)


def check_offloaded_stages(recipe: Recipe, model: Any) -> None:
    """Whole-model stages cannot run on an offloaded model: refuse them before any compute."""
    if not is_offloaded(model):
        return
    for item in recipe.stages:
        if not isinstance(item, SequentialSpec):
            check_stage_fits(model, item.stage, stage_def(item.stage).scope)


def check_save_dtype(recipe: Recipe, placement: Placement, model: Any) -> torch.dtype | None:
    """The dtype the weights are saved in when it differs from the compute dtype's setting (None: the model's
    own); an offloaded model is saved in its own dtype, so a ``save_dtype`` for it is refused."""
    save_dtype = DTYPES[recipe.model.save_dtype] if recipe.model.save_dtype else None
    if save_dtype is not None and save_dtype != placement.dtype and is_offloaded(model):
        raise SlimkitError("model.save_dtype: an offloaded model is saved in its own dtype; leave save_dtype unset")
    return save_dtype


def check_target_reachable(ctx: Context) -> None:
    """Before calibration: the first block's uniform layer-wise stages solve their share on the shapes alone, so a
    target their (aligned) units cannot land on is refused in one line before any compute; its allocated stages
    (global, search) are refused when even every group at its fewest allowed units falls short (where exactly they
    land depends on scores: checked when the block starts, still before any weight changes). Later blocks are
    checked when they start."""
    first = ctx.recipe.stages[0]
    checks = [
        (spec.stage, args) for spec in block_children(first)[0] if isinstance(args := spec.parsed_args(), ChecksReach)
    ]
    if not checks:
        return
    start_item(ctx, 0, first)
    try:
        for stage, args in checks:
            args.reach_check(ctx, stage)
    finally:  # the runner starts the block again when it runs
        ctx.block = Block()
