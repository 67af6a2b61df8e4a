"""`load(dir)`: rebuild a model saved by :func:`slimkit.save` (or any HF folder) with identical outputs.

Method note: docs/methods/saved-folders.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.derived_head_dim import build_values, saved_head_dims, set_saved_head_dims
from slimkit.primitives.arch.fused import split_fused
from slimkit.primitives.arch.head_widths import KIND as HEAD_WIDTHS_KIND
from slimkit.primitives.arch.head_widths import materialise_head_widths
from slimkit.primitives.arch.mixers import materialise_mixers
from slimkit.primitives.arch.moe import materialise_experts
from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.blocks.remove import restore_removed_blocks
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.compat import is_marked, unmark_config
from slimkit.primitives.io.folder import (
    TOKENIZER_FILES,
    ModelFolder,
    Purpose,
    check_model_folder,
    config_error_line,
    read_json_object,
)
from slimkit.primitives.io.paths import as_path
from slimkit.primitives.io.save import MANIFEST_NAME, layer_hidden_size
from slimkit.primitives.io.vision_language import TEXT_PREFIX, language_model, text_names, vision_language_of
from slimkit.primitives.lowrank.module import KIND as LOW_RANK_KIND
from slimkit.primitives.lowrank.module import materialise_lowrank
from slimkit.primitives.projection.adapters import KIND as BASIS_CHANGE_KIND
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE_NAME
from slimkit.primitives.projection.manifest import RMS_NORM_KIND, materialise_basis_changes, materialise_rms_norms

_MODULE_FIELDS = {
    LOW_RANK_KIND: ("rank", "in_features", "out_features"),
    RMS_NORM_KIND: ("width",),
    BASIS_CHANGE_KIND: ("in_features", "out_features"),
    HEAD_WIDTHS_KIND: ("head_size",),
}
"""The integer fields each kind of manifest ``modules`` entry must have."""


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's ``slimkit_manifest.json`` (None without one); a damaged one raises one line."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    manifest = read_json_object(path)
    modules = manifest.get("modules")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(e, dict) for e in modules)):
        raise SlimkitError(f"{path}: 'modules' must be a list of objects, got {json.dumps(modules)[:80]}")
    widths = manifest.get("layer_widths")
    if widths is not None and not (isinstance(widths, list) and all(isinstance(w, dict) for w in widths)):
        raise SlimkitError(f"{path}: 'layer_widths' must be a list of objects, got {json.dumps(widths)[:80]}")
    return manifest


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def json_floats(value: Any) -> Any:
    """``value`` with the floats JSON cannot hold decoded as transformers writes them in config.json
    (``{"__float__": "Infinity"}``: Mamba-2's ``time_step_limit``), for a config built from the parsed file."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {key: json_floats(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [json_floats(inner) for inner in value]
    return value


def folder_config(directory: str | os.PathLike) -> transformers.PretrainedConfig:
    """The checked folder's config as transformers builds it, for a slimkit output too (its mark removed, its
    global widths: the widest layer's, an upper bound for plans); no weights are read."""
    folder = check_model_folder(directory)
    config_dict = json_floats(unmark_config(folder.config))
    config_dict.pop("per_layer_config", None)
    model_type = config_dict.pop("model_type")
    config_dict.pop("transformers_version", None)
    return _from_config_file(folder, lambda: transformers.AutoConfig.for_model(model_type, **config_dict))


def _model_class(config: transformers.PretrainedConfig, task: str) -> type:
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel if task == "encoder" else transformers.AutoModelForCausalLM


def _load_state(folder: ModelFolder) -> dict[str, torch.Tensor]:
    """The tensors of exactly the weight files the checkpoint names (:attr:`ModelFolder.weight_files`)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in folder.weight_files:
        state.update(load_file(str(file)))
    return state


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__


def _from_config_file(folder: ModelFolder, build: Any) -> Any:
    """``build()`` (a transformers config or model from config.json), its errors as one line naming the file (and,
    for transformers' config validation, the field)."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return build()
    except StrictDataclassError as error:
        raise SlimkitError(config_error_line(folder.config_path, error, unmark_config(folder.config))) from None
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError) as error:
        raise SlimkitError(
            f"{folder.config_path}: transformers cannot build a model from it ({_first_line(error)})"
        ) from None


def _mismatch_fields(config: dict[str, Any], built: tuple[int, ...], saved: tuple[int, ...]) -> list[str]:
    """The config's integer fields whose value is a dimension only the config-built shape has."""
    only_built = set(built) - set(saved)
    return [k for k, v in config.items() if type(v) is int and v in only_built]


def _as_loaded(folder: ModelFolder, skeleton: nn.Module) -> ModelFolder:
    """``folder`` with its tensors under the names transformers loads them as into ``skeleton``: the renamings
    transformers registers for the model's classes (a checkpoint's ``embed_out.weight`` is GPT-NeoX's
    ``lm_head.weight``). A tensor a converter makes (several saved tensors stacked into one) counts as saved with
    the shape the model builds: its shape is left to transformers' own check.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without checkpoint conversions loads the names as saved
        return folder
    transforms = get_model_conversion_mapping(cast(Any, skeleton))
    if not transforms:
        return folder
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    built = {name: tuple(p.shape) for name, p in skeleton.named_parameters(remove_duplicate=False)}
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, str] = {}
    for key, shape in folder.shapes.items():
        name, converted = rename_source_key(key, renamings, cast(Any, converters))
        shapes[name] = built.get(name, shape) if converted is not None else shape
        files[name] = folder.files[key]
    return replace(folder, shapes=shapes, files=files)


def _check_shapes(
    folder: ModelFolder, model: nn.Module, config: dict[str, Any], prefix: str | None = None, hint: str = ""
) -> None:
    """Every parameter the config-built ``model`` shares (by name) with the saved weights has their shape.

    ``prefix``: the base model prefix a plain Hugging Face checkpoint may add or drop.
    """
    for name, param in model.named_parameters(remove_duplicate=False):
        candidates = [name]
        if prefix:
            candidates += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
        key = next((k for k in candidates if k in folder.shapes), None)
        if key is None:
            continue
        built, saved = tuple(param.shape), folder.shapes[key]
        if built != saved:
            fields = _mismatch_fields(config, built, saved)
            what = ", ".join(f"{k} ({config[k]})" for k in fields) if fields else "its widths"
            verb = "disagrees" if len(fields) == 1 else "disagree"
            raise SlimkitError(
                f"{folder.config_path}: {what} {verb} with the weights: {folder.files[key]} holds {key} of "
                f"shape {list(saved)}, the config builds {list(built)}{hint}"
            )


def _check_all_saved(folder: ModelFolder, model: nn.Module, prefix: str | None) -> None:
    """Every parameter the config-built ``model`` has (tied ones once) is in the weight files: transformers would
    otherwise initialise it at random and load without an error."""
    for name, _param in model.named_parameters():
        candidates = [name] + ([f"{prefix}.{name}", name.removeprefix(f"{prefix}.")] if prefix else [])
        if not any(k in folder.shapes for k in candidates):
            files = ", ".join(p.name for p in folder.weight_files)
            raise SlimkitError(
                f"{folder.config_path}: the config builds {name}, which no weight file ({files}) holds; "
                "transformers would initialise it at random"
            )


def _check_layer_widths(folder: ModelFolder, model: nn.Module, manifest: dict[str, Any]) -> None:
    """The manifest's ``layer_widths`` (what save recorded) agree with the widths the weights give."""
    recorded = manifest.get("layer_widths")
    if recorded is None:
        return
    path = folder.path / MANIFEST_NAME
    actual = ModelView(model).layer_widths()
    if len(recorded) != len(actual):
        raise SlimkitError(f"{path}: layer_widths lists {len(recorded)} layers, the weights hold {len(actual)}")
    for index, (want, have) in enumerate(zip(recorded, actual, strict=True)):
        wrong = [
            f"{k} {v} (the weights give {have[k]})" if k in have else f"{k} {v} (not a width slimkit records)"
            for k, v in want.items()
            if have.get(k) != v
        ]
        if wrong:
            raise SlimkitError(f"{path}: layer_widths[{index}] disagrees with the weights: {', '.join(wrong)}")


def _check_module_entries(folder: ModelFolder, model: nn.Module, modules: list[dict[str, Any]]) -> None:
    """Every manifest ``modules`` entry has a known kind, its fields, and a path the model has."""
    path = folder.path / MANIFEST_NAME
    for index, entry in enumerate(modules):
        where = f"{path}: modules[{index}]"
        kind, target = entry.get("kind"), entry.get("path")
        if kind not in _MODULE_FIELDS:
            raise SlimkitError(f"{where} has unknown kind {kind!r}; known: {', '.join(_MODULE_FIELDS)}")
        if not isinstance(target, str) or not target:
            raise SlimkitError(f"{where} ({kind}) has no path")
        bad = [f for f in _MODULE_FIELDS[kind] if type(entry.get(f)) is not int or entry[f] < 1]
        if bad:
            raise SlimkitError(f"{where} ({kind} at {target}) needs positive integer {', '.join(bad)}")
        largest = folder.largest_dimension
        too_large = [f"{f} {entry[f]}" for f in _MODULE_FIELDS[kind] if entry[f] > largest]
        if too_large:
            raise SlimkitError(
                f"{where} ({kind} at {target}): {', '.join(too_large)} larger than any dimension of the saved "
                f"weights (at most {largest})"
            )
        if kind == BASIS_CHANGE_KIND:
            if not target.endswith("." + BASIS_CHANGE_NAME):
                raise SlimkitError(f"{where} ({kind}) path {target} does not end in .{BASIS_CHANGE_NAME}")
            target = target.rpartition(".")[0]
        try:
            model.get_submodule(target)
        except AttributeError:
            raise SlimkitError(f"{where} ({kind}): the model has no module {target}") from None


def _check_module_shapes(
    folder: ModelFolder, model: nn.Module, modules: list[dict[str, Any]], kinds: tuple[str, ...]
) -> None:
    """Each materialised ``kinds`` entry's parameters have the saved shapes (else the entry was edited)."""
    path = folder.path / MANIFEST_NAME
    for index, entry in enumerate(modules):
        kind = entry["kind"]
        if kind not in kinds:
            continue
        fields = ", ".join(f"{f} {entry[f]}" for f in _MODULE_FIELDS[kind])
        where = f"{path}: modules[{index}] ({kind} at {entry['path']}: {fields})"
        for name, param in model.get_submodule(entry["path"]).named_parameters():
            key = f"{entry['path']}.{name}"
            if key not in folder.shapes:
                raise SlimkitError(f"{where}: the weights hold no {key}")
            if folder.shapes[key] != tuple(param.shape):
                raise SlimkitError(
                    f"{where} disagrees with the weights: {folder.files[key]} holds {key} of shape "
                    f"{list(folder.shapes[key])}, the entry implies {list(param.shape)}"
                )


def _per_layer_objects(folder: ModelFolder, per_layer: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(per_layer, dict) or not all(isinstance(v, dict) for v in per_layer.values()):
        raise SlimkitError(f"{folder.config_path}: per_layer_config must map layer indices to objects of widths")
    return per_layer


def _check_per_layer(folder: ModelFolder, per_layer: Any, num_layers: int) -> dict[str, dict[str, int]]:
    per_layer = _per_layer_objects(folder, per_layer)
    bad = [k for k in per_layer if not (str(k).isdigit() and int(k) < num_layers)]
    if bad:
        raise SlimkitError(
            f"{folder.config_path}: per_layer_config names layer(s) {', '.join(map(str, bad))} "
            f"of a model with {num_layers} layers"
        )
    return per_layer


def _same_class(module: nn.Module, **params: tuple[int, ...]) -> nn.Module:
    """A copy of ``module`` (same class and attributes) with fresh parameters of the given shapes."""
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    new._parameters = {name: nn.Parameter(torch.empty(shape)) for name, shape in params.items()}
    return new


def _resized(module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A fresh module of ``module``'s kind with the saved parameter shapes."""
    weight = shapes["weight"]
    if isinstance(module, nn.Linear):
        return nn.Linear(weight[1], weight[0], bias="bias" in shapes)
    if type(module) is nn.Embedding:
        return nn.Embedding(weight[0], weight[1], padding_idx=module.padding_idx)
    if isinstance(module, nn.Embedding):  # subclasses (OPT's positions) keep their forward and offsets
        new = _same_class(module, weight=weight)
        new.num_embeddings, new.embedding_dim = weight
        return new
    if isinstance(module, nn.LayerNorm):
        return nn.LayerNorm(weight[0], eps=module.eps, elementwise_affine=True, bias="bias" in shapes)
    if isinstance(module, nn.RMSNorm):
        return nn.RMSNorm(weight[0], eps=module.eps, elementwise_affine=True)
    if hasattr(module, "weight") and module.weight.dim() == 1:  # RMSNorm variants: same class, new width
        return _same_class(module, weight=weight)
    raise SlimkitError(f"cannot materialise a {type(module).__name__} of saved shape {weight}")


def _gains_parameter(model: nn.Module, name: str) -> str | None:
    """The module path when ``name`` is a saved parameter the built module registers as None."""
    module_path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return None
    return module_path if leaf in module._parameters and module._parameters[leaf] is None else None


def materialise_shapes(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """Replace every module whose parameters differ in shape from ``saved`` (or that lacks a saved bias)."""
    by_module: dict[str, dict[str, tuple[int, ...]]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, shape in saved.items():
        if name in params:
            if tuple(params[name].shape) != shape:
                by_module.setdefault(name.rpartition(".")[0], {})
        elif (module_path := _gains_parameter(model, name)) is not None:
            by_module.setdefault(module_path, {})
    for module_path in by_module:
        module = model.get_submodule(module_path)
        prefix = module_path + "."
        shapes = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
        parent_path, _, child = module_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, _resized(module, shapes))


def materialise_head_params(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """Give each attention's per-head parameters (:attr:`ArchSpec.head_params`) their saved shapes."""
    view = ModelView(model)
    if not view.spec.head_params:
        return
    names = {id(module): name for name, module in model.named_modules()}
    for layer in view.layers:
        for path in view.spec.head_params:
            owner_path, _, leaf = path.rpartition(".")
            try:
                owner = layer.module.get_submodule(owner_path)
            except AttributeError:  # a removed attention block
                continue
            shape = saved.get(f"{names[id(owner)]}.{leaf}")
            current = getattr(owner, leaf, None)
            if shape is not None and isinstance(current, torch.Tensor) and tuple(current.shape) != tuple(shape):
                setattr(owner, leaf, nn.Parameter(torch.empty(shape, dtype=current.dtype)))


def _check_widths(folder: ModelFolder, model: nn.Module, per_layer: dict[str, dict[str, int]]) -> None:
    view = ModelView(model)
    every = view.layer_widths()
    for index, expected in per_layer.items():
        layer = view.layer(int(index))
        actual = {**every[int(index)], "hidden_size": layer_hidden_size(layer, view.hidden_size)}
        wrong = [f"{k} {v} (the weights give {actual.get(k)})" for k, v in expected.items() if actual.get(k) != v]
        if wrong:
            raise SlimkitError(
                f"{folder.config_path}: per_layer_config layer {index} disagrees with the weights: {', '.join(wrong)}"
            )


def _instantiate(cls: type, config: Any, **kwargs: Any) -> nn.Module:
    """``cls`` built from ``config``: a model class's ``_from_config``, an Auto class's ``from_config``."""
    if hasattr(cls, "_from_config"):
        return cls._from_config(config, **kwargs)
    return cls.from_config(config, **kwargs)


_SHAPE_HINT = "; was a width in config.json edited, or its per_layer_config removed?"


def load(
    directory: str | os.PathLike,
    task: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_memory: str | int | None = None,
    offload_folder: str | os.PathLike | None = None,
    purpose: Purpose = "compress",
) -> tuple[nn.Module, Any]:
    """Load ``(model, tokenizer)`` from ``directory`` in eval mode.

    ``task``: ``causal-lm`` or ``encoder`` (default: from the config's ``model_type``). ``purpose``: ``compress``
    (the default) needs an architecture slimkit has an adapter for; ``evaluate`` also loads any plain causal LM
    transformers builds with its own classes (:func:`check_model_folder`).

    ``device``: auto (CUDA when available), cpu, cuda, cuda:N. ``dtype``: auto (float32 on CPU, bfloat16 on
    CUDA), float32, bfloat16, float16. ``max_memory`` (e.g. ``"20GiB"``): the weights' budget on the device;
    accelerate offloads what does not fit (to CPU memory with CUDA, else to disk in ``offload_folder``, by
    default a temporary folder under the cache removed with the model). Offloading loads plain Hugging Face
    folders (the input of a compression), not folders with per-layer widths.

    The folder is checked first (:func:`check_model_folder`: readable config, no custom code, safetensors
    weights with readable headers), then the config's widths, ``per_layer_config`` and the manifest's
    ``modules`` and ``layer_widths`` are compared with the saved tensor shapes; any disagreement is one
    :class:`SlimkitError` line naming the file and the entry. transformers never runs the folder's code.
    """
    directory = as_path(directory, "directory")
    try:
        return _load(directory, task, device, dtype, max_memory, offload_folder, purpose)
    except MemoryError:
        raise SlimkitError(
            f"{directory}: loading the model ran out of host memory (the machine's, or the process's limit: "
            "ulimit -v); free memory, raise the limit, or load it offloaded with max_memory"
        ) from None


def _load(
    directory: Path,
    task: str | None,
    device: str,
    dtype: str,
    max_memory: str | int | None,
    offload_folder: str | os.PathLike | None,
    purpose: Purpose,
) -> tuple[nn.Module, Any]:
    """The body of :func:`load`."""
    from slimkit.primitives.device.placement import Placement

    placement = Placement.resolve(device, dtype, max_memory)
    folder = check_model_folder(directory, task, purpose=purpose)
    task = folder.task
    marked = is_marked(folder.config)
    config_dict = json_floats(unmark_config(folder.config))
    per_layer = config_dict.pop("per_layer_config", None)
    manifest = read_manifest(directory) or {}
    modules = manifest.get("modules") or []

    if not marked and per_layer is None and not modules:
        standard = ("model.safetensors", "model.safetensors.index.json")
        if not any((directory / name).is_file() for name in standard):
            raise SlimkitError(
                f"{directory}: a plain Hugging Face folder keeps its weights in model.safetensors (or shards named by "
                f"model.safetensors.index.json); this one has {', '.join(sorted(set(folder.files.values())))}"
            )
        config = _from_config_file(
            folder, lambda: transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
        )
        cls = _model_class(config, task)
        with torch.device("meta"):
            skeleton = _from_config_file(folder, lambda: _instantiate(cls, config))
        prefix = getattr(cls, "base_model_prefix", None)
        loaded = _as_loaded(folder, skeleton)
        _check_shapes(loaded, skeleton, config_dict, prefix, _SHAPE_HINT)
        _check_all_saved(loaded, skeleton, prefix)
        _check_layer_widths(folder, language_model(split_fused(skeleton)), manifest)
        del skeleton
        tokenizer = _load_tokenizer(directory, config)  # before the weights: its ids are checked against the rows
        if placement.max_memory is not None:
            _refuse_offloaded_fused(directory, config, purpose)
            model = _load_offloaded(cls, directory, config, placement, offload_folder)
        elif placement.gpus:
            from slimkit.primitives.device.offload import load_spread

            model = load_spread(cls, directory, config, placement)
        else:
            on_gpu = {"device_map": {"": placement.device}} if placement.device.type != "cpu" else {}
            model = cls.from_pretrained(
                directory, dtype=placement.dtype, trust_remote_code=False, use_safetensors=True, **on_gpu
            )
        if placement.max_memory is None:
            split_fused(model)  # fused projections seen as their parts (exact)
        return model.eval(), tokenizer
    if placement.max_memory is not None:
        raise SlimkitError(
            f"{directory}: max_memory offloads plain Hugging Face folders; this one has per-layer widths or "
            "low-rank modules (a slimkit output): load it without max_memory"
        )

    model_type = config_dict.pop("model_type")
    config_dict.pop("transformers_version", None)
    # Built from the global widths (a head count the attention's constructor accepts where it derives the head width
    # from the config); the saved per-layer widths are materialised below.
    spec = ARCH_SPECS.get(model_type)
    head_dims: dict[int, int] = {}
    build: dict[str, int] = {}
    if per_layer is not None and spec is not None and spec.head_dim_from_hidden:
        head_dims = saved_head_dims(spec, _per_layer_objects(folder, per_layer), str(folder.config_path))
        build = build_values(spec, config_dict, head_dims)
    config = _from_config_file(
        folder, lambda: transformers.AutoConfig.for_model(model_type, **{**config_dict, **build})
    )
    model = _from_config_file(folder, lambda: _instantiate(_model_class(config, task), config, dtype=placement.dtype))
    for key in build:  # the config says what was saved; the modules get the saved widths below
        setattr(model.config, key, config_dict[key])
    whole = model
    vision = vision_language_of(config_dict)
    if vision is not None:  # the widths are the language model's: materialised on it, under its own names
        model = language_model(whole)
        folder = replace(
            folder,
            shapes=text_names(folder.shapes, vision),
            files={
                TEXT_PREFIX + k[len(vision.prefix) :] if k.startswith(vision.prefix) else k: v
                for k, v in folder.files.items()
            },
        )
    split_fused(model)  # a saved folder holds fused projections as their parts
    saved = folder.shapes
    _check_module_entries(folder, model, modules)
    materialise_lowrank(model, modules)
    materialise_rms_norms(model, modules)
    _check_module_shapes(folder, model, modules, (LOW_RANK_KIND, RMS_NORM_KIND))
    if per_layer is None:
        # save() writes no per_layer_config only when the config's global widths build every saved shape.
        _check_shapes(folder, model, config_dict, hint=_SHAPE_HINT)
    else:
        per_layer = _check_per_layer(folder, per_layer, ModelView(model).num_layers)
        restore_removed_blocks(model, per_layer)  # zero heads / zero MLP width: the block was removed
        set_saved_head_dims(model, head_dims)
    try:
        materialise_head_widths(model, ModelView(model).spec, modules, saved)
    except SlimkitError as error:
        raise SlimkitError(f"{folder.path / MANIFEST_NAME}: {error}") from None
    materialise_experts(model, saved)  # per-layer expert counts: router rows and fused expert tensors
    materialise_head_params(model, saved)  # per-head vectors of an attention (GPT-OSS's sinks)
    materialise_mixers(model, saved)  # a hybrid's per-layer mixer widths: gated DeltaNet and Mamba-2 heads
    materialise_shapes(model, saved)
    materialise_basis_changes(model, modules)
    _check_module_shapes(folder, model, modules, (BASIS_CHANGE_KIND,))
    view = ModelView(model)
    for layer in view.layers:
        layer.sync_head_counts()
    if per_layer:
        _check_widths(folder, model, per_layer)
    _check_layer_widths(folder, model, manifest)
    # Materialised modules are built in float32; the whole model takes the requested dtype at once.
    model = whole  # a vision-language model: the vision tower and projector as built, the weights below
    model.to(dtype=placement.dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    tokenizer = _load_tokenizer(directory, config)
    state = _load_state(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    head = view.spec.head
    tied = {k for k in missing if view.tied and head is not None and k.startswith(head + ".")}
    if set(missing) - tied or unexpected:
        raise SlimkitError(
            f"{directory}: weights do not match the model (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    if placement.gpus:
        from slimkit.primitives.device.offload import dispatch_spread

        return dispatch_spread(model, placement), tokenizer
    return model.to(placement.device).eval(), tokenizer


def _refuse_offloaded_fused(directory: Path, config: Any, purpose: str) -> None:
    """One line for compressing an offloaded model with fused projections (its weights are not in memory to split)."""
    spec = ARCH_SPECS.get(getattr(config, "model_type", None) or "")
    if purpose == "compress" and spec is not None and spec.fused:
        fused = ", ".join(f.path for f in spec.fused)
        raise SlimkitError(
            f"{directory}: a {spec.model_type} model is compressed with its fused projections ({fused}) split into "
            "their parts, which offloaded weights (max_memory) cannot be; load it without max_memory"
        )


def _load_offloaded(cls: type, directory: Path, config: Any, placement: Any, offload_folder: Any) -> nn.Module:
    import tempfile
    import weakref

    from slimkit.primitives.datasets.data_paths import cache_root
    from slimkit.primitives.device.offload import load_offloaded
    from slimkit.primitives.files.removal import discard

    if offload_folder is None:
        (cache_root() / "offload").mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=cache_root() / "offload"))
        model = load_offloaded(cls, directory, config, placement, folder)
        weakref.finalize(model, discard, folder)
        return model
    return load_offloaded(cls, directory, config, placement, Path(offload_folder))


def folder_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer of a checked model folder (None when it has none), as :func:`load` gives it, without reading any
    weight: for checks that tokenise data before compute."""
    return _load_tokenizer(Path(directory), folder_config(directory))


def _load_tokenizer(directory: Path, config: transformers.PretrainedConfig) -> Any:
    """The folder's tokenizer (None when it has none), loaded before the weights and refused in one line when
    it can produce an id the model's embedding has no row for (:func:`check_token_ids`)."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    # The config is passed so the tokenizer never parses config.json (whose per_layer_config
    # transformers would turn into a heterogeneous config, and whose marked model_type it does not know).
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, config=config, trust_remote_code=False)
    except Exception as error:  # a damaged tokenizer file: tokenizers raises plain Exceptions
        raise SlimkitError(
            f"{directory}: cannot load the tokenizer ({type(error).__name__}: {_first_line(error)})"
        ) from None
    check_token_ids(directory, tokenizer, config)
    return tokenizer


def check_token_ids(directory: Path, tokenizer: Any, config: transformers.PretrainedConfig) -> None:
    """One-line error when ``tokenizer`` has a token whose id is at or beyond the embedding's rows (the config's
    ``vocab_size``, which the weights' shapes are checked against): text holding that token would index past
    the embedding in the middle of a run. Fewer tokens than rows (padded vocabularies) are fine."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    ids = tokenizer.get_vocab().values()
    if not isinstance(rows, int) or not ids:
        return
    largest = max(ids)
    if largest >= rows:
        token = tokenizer.convert_ids_to_tokens(largest)
        raise SlimkitError(
            f"{directory}: the tokenizer has token ids up to {largest} ({token!r}) but the model's embedding has "
            f"{rows} rows (config vocab_size {rows}); every id must be below {rows}: use the tokenizer saved with "
            "these weights"
        )
