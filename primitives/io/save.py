"""`save(model, tokenizer, dir, manifest)`: a folder another program can read.

Weights, config and tokenizer as ``save_pretrained`` writes them, plus ``slimkit_manifest.json`` recording what the
config cannot (per-layer widths, low-rank pairs, residual matrices).

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.fused import fused_for_save, split_fused
from slimkit.primitives.arch.head_widths import head_width_entries
from slimkit.primitives.arch.layer_kinds import merged_widths
from slimkit.primitives.arch.moe import moe_spec
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import remove_leftovers, staging_dir
from slimkit.primitives.files.guard import check_output_location
from slimkit.primitives.files.lock import acquire_lock
from slimkit.primitives.files.removal import discard
from slimkit.primitives.files.writable import check_writable
from slimkit.primitives.io.compat import mark_config, structure_reasons, unmark_config
from slimkit.primitives.io.finite import non_finite_tensors
from slimkit.primitives.io.paths import as_path, check_path_length
from slimkit.primitives.io.vision_language import attached
from slimkit.primitives.lowrank.module import lowrank_entries
from slimkit.primitives.projection.manifest import projection_entries

MANIFEST_NAME = "slimkit_manifest.json"
MANIFEST_FORMAT = 1
_VERSIONED = ("slimkit", "torch", "transformers", "torch-pruning", "peft", "lm-eval", "datasets")


def versions() -> dict[str, str]:
    found = {}
    for name in _VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def config_accepts(config_class: type, values: dict[str, Any]) -> bool:
    try:
        config_class(**values).validate()
    except Exception:
        return False
    return True


def layer_hidden_size(layer: LayerView, stream: int) -> int:
    """The hidden width a layer works in: the input width of the first projection it has that reads the residual
    stream (q, or up once its attention block was removed); ``stream`` (the residual stream's width) for a layer
    whose attention and MLP blocks were both removed (it passes the stream on unchanged)."""
    for role in ("q", "up"):
        if role == "q" and layer.spec.latent_attention is not None and not layer.attention_removed:
            return int(layer.extra_linears()[0].in_features)  # MLA's q reads the latent; q_a reads the stream
        if role in layer.roles:
            return int(layer.linear(role).in_features)
    return stream


def _rebuilds(model: nn.Module, values: dict[str, Any]) -> bool:
    """Whether a model built from ``values`` has the saved shape of every parameter both models have
    (and each bias the model has); modules recorded in the manifest are not compared."""
    config = type(model.config)(**values)
    try:
        with torch.device("meta"):
            built = split_fused(type(model)(config))
    except Exception:
        return False
    built_params = dict(built.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in built_params:
            if tuple(built_params[name].shape) != tuple(param.shape):
                return False
            continue
        module_path, _, leaf = name.rpartition(".")
        try:
            module = built.get_submodule(module_path)
        except AttributeError:
            continue
        if leaf in module._parameters:  # e.g. a head bias the built model has not got
            return False
    return True


def width_config(model: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, int]] | None]:
    """Global config updates and the ``per_layer_config`` (None when uniform and representable)."""
    view = ModelView(model)
    widths = view.layer_widths()
    hidden_sizes = [layer_hidden_size(layer, view.hidden_size) for layer in view.layers]
    config_dict = model.config.to_dict()
    hidden = {"hidden_size": view.hidden_size}
    uniform = merged_widths(widths)  # a hybrid's layers give the widths of the kinds they hold
    if uniform is not None and all(h == view.hidden_size for h in hidden_sizes):
        candidate = {**config_dict, **uniform, **hidden}
        candidate.pop("model_type", None)
        candidate.pop("transformers_version", None)
        if config_accepts(type(model.config), candidate) and _rebuilds(model, candidate):
            return {**uniform, **hidden}, None
    per_layer = {str(i): dict(w) for i, w in enumerate(widths)}
    if any(h != view.hidden_size for h in hidden_sizes) or view.hidden_size != model.config.hidden_size:
        for index, size in enumerate(hidden_sizes):
            per_layer[str(index)]["hidden_size"] = size
    return {}, per_layer


WEIGHTS_PREFIX = "slimkit-"
"""Prefix of the weight files of a slimkit-only folder (``slimkit-model.safetensors``)."""


def rename_weight_files(folder: Path) -> None:
    """Rename ``model*.safetensors`` (and the shard index) to ``slimkit-model*...``.

    A model class called directly (``LlamaForCausalLM.from_pretrained``) never refuses a config, so a
    marked config alone would let it load a low-rank folder with random projections; without a
    ``model.safetensors`` it fails with "no file named model.safetensors", as vLLM and other loaders do.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: WEIGHTS_PREFIX + v for k, v in data.get("weight_map", {}).items()}
        _write_json(folder / (WEIGHTS_PREFIX + index.name), data)
        index.unlink()
    for file in folder.glob("model*.safetensors"):
        file.rename(folder / (WEIGHTS_PREFIX + file.name))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _name_tokenizer_class(directory: Path, tokenizer: Any) -> None:
    """Make ``tokenizer_config.json`` name the tokenizer class, so ``AutoTokenizer`` needs no model config."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if not data.get("tokenizer_class"):
        data["tokenizer_class"] = type(tokenizer).__name__
        _write_json(path, data)


def check_finite(model: nn.Module) -> None:
    """Raise :class:`SlimkitError` (one line) when a tensor ``save`` would write holds NaN or inf."""
    bad, checked = non_finite_tensors(model)
    if bad:
        shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise SlimkitError(f"{len(bad)} of {checked} tensors hold NaN/inf ({shown}); nothing was written")


def save(
    model: nn.Module, tokenizer: Any, directory: str | os.PathLike, manifest: dict[str, Any] | None = None
) -> Path:
    """Write ``model`` (and ``tokenizer`` if given) to ``directory`` atomically; returns the path.

    ``directory`` must not exist or must be empty; it is replaced in one rename. A model with a NaN or
    inf weight raises :class:`SlimkitError` before anything is written. The output rules of every command that
    writes apply: never through a symbolic link, never a protected folder (root, home, the working folder or a
    parent of it), and one writer at a time (the lock ``.NAME.lock`` beside ``directory``: a second save to the
    same folder is refused in one line while the first runs).
    """
    target = as_path(directory, "directory")
    check_output_location("slimkit.save", target, (), "slimkit.save")
    check_path_length("slimkit.save", target)
    check_writable("slimkit.save", target)
    if target.exists() and not target.is_dir():
        raise SlimkitError(f"slimkit.save {target}: exists and is not a folder")
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty")
    check_finite(model)
    global_widths, per_layer = width_config(model)
    view = ModelView(model)

    try:
        held = acquire_lock(target)
    except OSError as error:  # a file system that takes no new file there (/proc, /sys), a full disk
        raise SlimkitError(
            f"slimkit.save {target}: cannot create the lock file beside it ({error.strerror or error}); save into a "
            "folder on a writable file system"
        ) from None
    try:
        _write_folder(model, tokenizer, target, view, global_widths, per_layer, manifest)
    finally:
        held.release()
    return target


def _write_folder(
    model: nn.Module,
    tokenizer: Any,
    target: Path,
    view: ModelView,
    global_widths: dict[str, Any],
    per_layer: dict[str, dict[str, int]] | None,
    manifest: dict[str, Any] | None,
) -> None:
    """The body of :func:`save`, run while it holds the lock on ``target``: build in a hidden sibling, rename."""
    remove_leftovers(target)  # what a killed earlier write left beside it
    tmp = staging_dir(target)
    try:
        # save_pretrained validates the in-memory config, which still holds HF-valid global widths.
        # An offloaded model (accelerate hooks) is written shard by shard from its offloaded weights: small
        # shards keep the memory that takes small.
        offloaded = any(where in ("cpu", "disk") for where in (getattr(model, "hf_device_map", None) or {}).values())
        # A MoE model is written with its fused expert tensors as they are in memory (transformers would otherwise
        # split them back into the hub's per-expert layout, which slimkit's shape checks do not read).
        record = {
            "format": MANIFEST_FORMAT,
            "model_type": view.spec.model_type,
            "layer_widths": view.layer_widths(),
            "modules": lowrank_entries(model) + projection_entries(model) + head_width_entries(model),
            "versions": versions(),
            **(manifest or {}),
        }
        reasons = structure_reasons(per_layer, record.get("modules"))
        whole = attached(model)  # a vision-language model's language model: the whole model is written
        if whole is not None:
            record["vision_language_model"] = type(whole).__name__
        # A plain folder holds fused projections as the stock model does; a slimkit-only one holds their parts.
        with nullcontext() if reasons else fused_for_save(model):
            (whole or model).save_pretrained(
                tmp,
                safe_serialization=True,
                max_shard_size="1GB" if offloaded else "5GB",
                # a slimkit-only folder is read by slimkit's loader, under the names the model holds (Nemotron-H's
                # original format renames model.* to backbone.*); a vision-language model is written as it is
                save_original_format=moe_spec(model) is None and whole is None and not reasons,
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config = unmark_config(json.loads(config_path.read_text()))
        (config["text_config"] if whole is not None else config).update(global_widths)
        if per_layer is not None:
            config["per_layer_config"] = per_layer
        if reasons:
            config = mark_config(config, reasons)
            rename_weight_files(tmp)
            if tokenizer is not None:
                _name_tokenizer_class(tmp, tokenizer)
        _write_json(config_path, config)
        _write_json(tmp / MANIFEST_NAME, record)
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    finally:
        discard(tmp)
