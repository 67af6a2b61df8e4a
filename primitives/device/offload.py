"""Models larger than the memory budget: accelerate offloading, and one layer at a time on the device.

Method note: docs/methods/devices-offload.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.device.placement import Placement, dtype_name, format_size
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.removal import discard


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def module_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s floating-point parameters in ``dtype`` (shapes only: works on meta tensors)."""
    size = _dtype_bytes(dtype)
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in module.parameters())


def plan_device_map(empty_model: nn.Module, layers: list[nn.Module], placement: Placement) -> dict[str, Any]:
    """A device map for ``empty_model`` (on meta) within ``placement.max_memory``.

    Everything outside the decoder layers (embeddings, tied head, final norm) stays on the compute device:
    the calibration capture and every forward pass start there, and accelerate cannot split tied weights
    between memory and disk. Whole layers then fill the rest of the budget in order; the layers that do
    not fit go to CPU memory (when computing on a GPU, as far as accelerate's estimate of free RAM goes)
    and then to disk. Refuses a budget that leaves less than one layer for layer-wise compression.
    """
    from accelerate.utils import get_max_memory

    assert placement.max_memory is not None
    device = placement.device
    compute: Any = "cpu" if device.type == "cpu" else (device.index or 0)
    names = {id(module): name for name, module in empty_model.named_modules()}
    layer_names = [names[id(layer)] for layer in layers]
    layer_sizes = [module_bytes(layer, placement.dtype) for layer in layers]
    resident = module_bytes(empty_model, placement.dtype) - sum(layer_sizes)  # embeddings, head, final norm
    left = placement.max_memory - resident
    if left < max(layer_sizes):
        raise SlimkitError(
            f"model.max_memory {format_size(placement.max_memory)} leaves {format_size(max(left, 0))} after the "
            f"embeddings and head ({format_size(resident)}), less than one decoder layer "
            f"({format_size(max(layer_sizes))} in {dtype_name(placement.dtype)}); layer-wise compression needs "
            "them plus one layer and its calibration activations on the device"
        )
    cpu_left = get_max_memory()["cpu"] if device.type != "cpu" else 0
    device_map: dict[str, Any] = {}
    for name, size in zip(layer_names, layer_sizes, strict=True):
        if size <= left:
            device_map[name], left = compute, left - size
        elif size <= cpu_left:
            device_map[name], cpu_left = "cpu", cpu_left - size
        else:
            device_map[name], left = "disk", 0
    # Everything else: the top-level children that hold no layer, and the layers' container's other children.
    for name, _module in empty_model.named_modules():
        if not name or name in device_map or any(n.startswith(name + ".") or n == name for n in layer_names):
            continue
        if any(name.startswith(key + ".") for key in device_map):
            continue
        device_map[name] = compute
    return device_map


def spread_device_map(
    empty_model: nn.Module, layers: list[nn.Module], budgets: dict[int, int], dtype: torch.dtype
) -> dict[str, Any]:
    """A device map spreading ``empty_model`` (on meta) over several GPUs, ``budgets`` bytes each (GPU index ->
    bytes), whole decoder layers per GPU, by accelerate (``get_balanced_memory`` then ``infer_auto_device_map``, with
    tied weights kept together). Refuses in one line when the weights do not fit the GPUs' budgets (nothing is sent
    to CPU memory or disk here: that is ``model.max_memory``'s offload)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted({type(layer).__name__ for layer in layers})
    limits: dict[Any, int] = {**budgets, "cpu": 0}
    balanced = get_balanced_memory(empty_model, max_memory=limits, no_split_module_classes=no_split, dtype=dtype)
    device_map = infer_auto_device_map(
        empty_model, max_memory={**balanced, "cpu": 0}, no_split_module_classes=no_split, dtype=dtype
    )
    outside = sorted({str(where) for where in device_map.values() if not isinstance(where, int)})
    if outside:
        need = format_size(module_bytes(empty_model, dtype))
        have = ", ".join(f"cuda:{index} {format_size(size)}" for index, size in budgets.items())
        raise SlimkitError(
            f"device auto: the weights ({need} in {dtype_name(dtype)}) do not fit the visible GPUs ({have} free); "
            "set model.max_memory to offload layers to CPU memory or disk, or use a smaller dtype"
        )
    return device_map


def gpu_budgets(gpus: tuple[int, ...], headroom: float = 0.1) -> dict[int, int]:
    """Free memory of each GPU in ``gpus`` less ``headroom`` of it (activations, statistics)."""
    return {index: int(torch.cuda.mem_get_info(index)[0] * (1 - headroom)) for index in gpus}


def load_spread(model_class: Any, folder: Path, config: Any, placement: Placement) -> nn.Module:
    """``model_class.from_pretrained(folder)`` with its layers spread over ``placement.gpus``; each layer computes on
    the GPU it lives on (accelerate's hooks move the inputs)."""
    from accelerate import init_empty_weights

    from slimkit.primitives.arch import ModelView

    with init_empty_weights():
        empty = model_class._from_config(config, dtype=placement.dtype)
    empty.tie_weights()
    layers = [layer.module for layer in ModelView(empty).layers]
    device_map = spread_device_map(empty, layers, gpu_budgets(placement.gpus), placement.dtype)
    return model_class.from_pretrained(folder, dtype=placement.dtype, device_map=device_map).eval()


def dispatch_spread(model: nn.Module, placement: Placement) -> nn.Module:
    """A model built in memory (a slimkit output with per-layer widths) spread over ``placement.gpus``."""
    from accelerate import dispatch_model

    from slimkit.primitives.arch import ModelView

    layers = [layer.module for layer in ModelView(model).layers]
    device_map = spread_device_map(model, layers, gpu_budgets(placement.gpus), placement.dtype)
    return dispatch_model(model, device_map=device_map).eval()


def load_offloaded(
    model_class: Any, folder: Path, config: Any, placement: Placement, offload_folder: Path
) -> nn.Module:
    """``model_class.from_pretrained(folder)`` dispatched by accelerate within ``placement.max_memory``."""
    from accelerate import init_empty_weights

    from slimkit.primitives.arch import ModelView

    with init_empty_weights():
        empty = model_class._from_config(config, dtype=placement.dtype)
    empty.tie_weights()
    layers = [layer.module for layer in ModelView(empty).layers]
    device_map = plan_device_map(empty, layers, placement)
    model = model_class.from_pretrained(
        folder, dtype=placement.dtype, device_map=device_map, offload_folder=str(offload_folder)
    )
    model._slimkit_offload = OffloadState(placement.device, offload_folder)
    return model.eval()


class OffloadState:
    """What a model loaded by :func:`load_offloaded` carries: the compute device and its offload folder."""

    def __init__(self, device: torch.device, folder: Path) -> None:
        self.device = device
        self.folder = folder


def offload_state(model: nn.Module) -> OffloadState | None:
    return getattr(model, "_slimkit_offload", None)


def _offloaded(where: Any, device: torch.device) -> bool:
    """Whether a device-map entry is off the compute device: disk, or CPU memory when computing on a GPU."""
    return where == "disk" or (where == "cpu" and device.type != "cpu")


def is_offloaded(model: nn.Module) -> bool:
    """Whether some of ``model``'s weights live off the compute device (in CPU memory or on disk)."""
    state = offload_state(model)
    device_map = getattr(model, "hf_device_map", None) or {}
    return state is not None and any(_offloaded(where, state.device) for where in device_map.values())


def _storage(model: nn.Module, name: str) -> str | None:
    """Where ``name`` (a module path) is offloaded to ("cpu" or "disk"), or None when it is on the device."""
    state = offload_state(model)
    device_map = getattr(model, "hf_device_map", None) or {}
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        key = ".".join(parts[:end])
        if key in device_map:
            where = device_map[key]
            return where if state is not None and _offloaded(where, state.device) else None
    return None


@contextmanager
def resident(model: nn.Module, name: str, module: nn.Module) -> Iterator[nn.Module]:
    """``module`` (at path ``name``) with real weights on the compute device while the block runs.

    A module that is not offloaded is yielded as it is. An offloaded one is onloaded, and afterwards
    written back where it came from with accelerate's hooks attached again (its shapes may have changed).
    If the block raises, nothing is written back (the run is abandoned).
    """
    state = offload_state(model)
    where = _storage(model, name)
    if state is None or where is None:
        yield module
        return
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_module
    from accelerate.utils import OffloadedWeightsLoader, offload_state_dict, set_module_tensor_to_device
    from transformers.integrations.accelerate import load_offloaded_parameter

    device = state.device
    tensors = dict(module.named_parameters())
    values = {
        key: (load_offloaded_parameter(model, f"{name}.{key}") if t.device.type == "meta" else t)
        for key, t in tensors.items()
    }
    remove_hook_from_module(module, recurse=True)
    for key, value in values.items():
        set_module_tensor_to_device(module, key, device, value=value)
    module.to(device)
    del values
    yield module
    weights = {key: t.detach().to("cpu") for key, t in module.named_parameters()}
    if where == "disk":
        folder = state.folder / "slimkit-layers" / name
        discard(folder)
        offload_state_dict(folder, weights)
        del weights
        weights_map: Any = OffloadedWeightsLoader(save_folder=str(folder))
    else:
        weights_map = weights
    attach_align_device_hook(module, execution_device=device, offload=True, weights_map=weights_map)


def check_stage_fits(model: nn.Module, stage: str, scope: str) -> None:
    """Refuse a whole-model stage on an offloaded model (one line saying what it needs)."""
    if scope == "model" and is_offloaded(model):
        state = offload_state(model)
        dtype = next(model.parameters()).dtype
        need = format_size(module_bytes(model, dtype))
        device = state.device if state else "the device"
        raise SlimkitError(
            f"stage '{stage}' works on the whole model at once (about {need} of weights in {dtype_name(dtype)} "
            f"on {device}, plus gradients/activations), but model.max_memory offloads part of it; offloaded "
            "models run layer stages only (sequential, prune_layer): raise max_memory or drop the stage"
        )
