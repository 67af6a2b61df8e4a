"""`load(dir)`: rebuild a model saved by :func:`slimkit.save` (or any HF folder) with identical outputs.

A marked ``config.json`` (``model_type`` ``slimkit_compressed``, see :mod:`.compat`) gets its
original ``model_type`` and ``architectures`` back first. A folder that is not marked and has no
``per_layer_config`` and no manifest modules goes through the model class's own
``from_pretrained``. Otherwise (marked folders, and folders saved before the mark existed) the
model is built from the global config, the manifest's modules are put in place (low-rank pairs;
RMSNorms that replaced LayerNorms), every module whose saved parameters differ in shape (or that
gains a saved bias, e.g. a head that took a LayerNorm's β) is given a module of the saved shape
(shape-driven materialisation, so no architecture's forward pass is copied), the manifest's
residual / basis-change matrices are attached with their hooks, each layer's attention head
attributes are re-synced from its projection shapes, and the weights are loaded strictly. The
materialised widths (per-layer hidden sizes included) are then checked against ``per_layer_config``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn

from slimkit.primitives.arch import ModelView, check_supported
from slimkit.primitives.arch.support import task_of
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.compat import is_marked, unmark_config
from slimkit.primitives.io.save import MANIFEST_NAME, layer_hidden_size
from slimkit.primitives.lowrank.module import materialise_lowrank
from slimkit.primitives.projection.manifest import materialise_basis_changes, materialise_rms_norms


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def _model_class(config: transformers.PretrainedConfig, task: str) -> type:
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel if task == "encoder" else transformers.AutoModelForCausalLM


def _saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SlimkitError(f"{directory} holds no .safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _load_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


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


def _check_widths(model: nn.Module, per_layer: dict[str, dict[str, int]]) -> None:
    view = ModelView(model)
    for index, expected in per_layer.items():
        layer = view.layer(int(index))
        actual = {**layer.widths(), "hidden_size": layer_hidden_size(layer)}
        wrong = {k: (v, actual.get(k)) for k, v in expected.items() if actual.get(k) != v}
        if wrong:
            raise SlimkitError(f"layer {index}: saved weights disagree with per_layer_config {wrong}")


def load(
    directory: str | os.PathLike,
    task: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_memory: str | int | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> tuple[nn.Module, Any]:
    """Load ``(model, tokenizer)`` from ``directory`` in eval mode.

    ``task``: ``causal-lm`` or ``encoder`` (default: from the config's ``model_type``).

    ``device``: auto (CUDA when available), cpu, cuda, cuda:N. ``dtype``: auto (float32 on CPU, bfloat16 on
    CUDA), float32, bfloat16, float16. ``max_memory`` (e.g. ``"20GiB"``): the weights' budget on the device;
    accelerate offloads what does not fit (to CPU memory with CUDA, else to disk in ``offload_folder``, by
    default a temporary folder under the cache removed with the model). Offloading loads plain Hugging Face
    folders (the input of a compression), not folders with per-layer widths.
    """
    from slimkit.primitives.placement import Placement

    placement = Placement.resolve(device, dtype, max_memory)
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise SlimkitError(f"{directory} is not a model folder (no config.json)")
    try:
        config_dict = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise SlimkitError(f"{directory}: cannot read config.json ({error})") from None
    task = task or task_of(config_dict)
    check_supported(config_dict, task)
    marked = is_marked(config_dict)
    config_dict = unmark_config(config_dict)
    per_layer = config_dict.pop("per_layer_config", None)
    manifest = read_manifest(directory) or {}

    if not marked and per_layer is None and not manifest.get("modules"):
        config = transformers.AutoConfig.from_pretrained(directory)
        cls = _model_class(config, task)
        if placement.max_memory is not None:
            model = _load_offloaded(cls, directory, config, placement, offload_folder)
        else:
            on_gpu = {"device_map": {"": placement.device}} if placement.device.type != "cpu" else {}
            model = cls.from_pretrained(directory, dtype=placement.dtype, **on_gpu)
        return model.eval(), _load_tokenizer(directory, config)
    if placement.max_memory is not None:
        raise SlimkitError(
            f"{directory}: max_memory offloads plain Hugging Face folders; this one has per-layer widths or "
            "low-rank modules (a slimkit output): load it without max_memory"
        )

    model_type = config_dict.pop("model_type")
    config_dict.pop("transformers_version", None)
    # Built from the global (HF-valid) widths; the saved per-layer widths are materialised below.
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    tokenizer = _load_tokenizer(directory, config)
    model = _model_class(config, task)._from_config(config, dtype=placement.dtype)
    saved = _saved_shapes(directory)
    modules = manifest.get("modules", [])
    materialise_lowrank(model, modules)
    materialise_rms_norms(model, modules)
    materialise_shapes(model, saved)
    materialise_basis_changes(model, modules)
    view = ModelView(model)
    for layer in view.layers:
        layer.sync_head_counts()
    # Materialised modules are built in float32; the whole model takes the requested dtype at once.
    model.to(dtype=placement.dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    state = _load_state(directory)
    missing, unexpected = model.load_state_dict(state, strict=False)
    head = view.spec.head
    tied = {k for k in missing if view.tied and head is not None and k.startswith(head + ".")}
    if set(missing) - tied or unexpected:
        raise SlimkitError(
            f"{directory}: weights do not match the model (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    if per_layer:
        _check_widths(model, per_layer)
    return model.to(placement.device).eval(), tokenizer


def _load_offloaded(cls: type, directory: Path, config: Any, placement: Any, offload_folder: Any) -> nn.Module:
    import shutil
    import tempfile
    import weakref

    from slimkit.primitives.offload import load_offloaded
    from slimkit.primitives.paths import cache_root

    if offload_folder is None:
        (cache_root() / "offload").mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=cache_root() / "offload"))
        model = load_offloaded(cls, directory, config, placement, folder)
        weakref.finalize(model, shutil.rmtree, str(folder), True)
        return model
    return load_offloaded(cls, directory, config, placement, Path(offload_folder))


def _load_tokenizer(directory: Path, config: transformers.PretrainedConfig) -> Any:
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    # The config is passed so the tokenizer never parses config.json (whose per_layer_config
    # transformers would turn into a heterogeneous config, and whose marked model_type it does not know).
    return transformers.AutoTokenizer.from_pretrained(directory, config=config)
