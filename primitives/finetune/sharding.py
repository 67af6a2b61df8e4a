"""A student sharded over the launched processes for full-parameter recovery (torch's FSDP2 ``fully_shard``): each
process holds 1/world of every float32 weight, gradient and AdamW moment; a unit's weights are gathered for its
forward and backward only (in bfloat16 for a bfloat16 model, its gradients reduced in float32). Gradients are
summed, not averaged, over the processes (the recovery loop divides each loss by the global batch's token count
itself). A checkpoint holds each process's own shards (nothing gathered); the full weights come back gathered, one
at a time, into a plain model on every process at the end (the rest of the recipe runs on each).

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.process_group import world as process_world


def to_float32(module: nn.Module, recurse: bool = True) -> None:
    """``module``'s floating-point parameters in float32, in place (a tied weight is one parameter, cast once)."""
    for param in module.parameters(recurse=recurse):
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory; tied weights stay tied, buffers and
    modules are copied): what :func:`gather_into` fills with the trained weights after sharding."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def _process_mesh(model: nn.Module):
    """The one-dimensional device mesh of the launched processes on ``model``'s device type; one line when this is
    one process."""
    from torch.distributed.device_mesh import init_device_mesh

    world = process_world()[1]
    if world < 2:
        raise SlimkitError("sharding: fsdp needs several launched processes; this is one (use sharding: none)")
    return init_device_mesh(next(model.parameters()).device.type, (world,))


def shard_model(model: nn.Module, units: Sequence[nn.Module], compute_dtype: torch.dtype | None = None) -> None:
    """Shard ``model`` in place over the process group: each of ``units`` (the decoder layers) its own FSDP unit,
    the rest (embeddings, final norm, head) the root's; each unit is cast to float32 just before it is sharded, so
    the whole model is never held in float32. ``compute_dtype`` (bfloat16 for a bfloat16 model): the weights are
    gathered and computed in it and the gradients reduced in float32 (FSDP2's ``MixedPrecisionPolicy``); None: in
    float32. Every process must hold the same weights (the launched processes run the same recipe on the same
    seed)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = _process_mesh(model)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    for unit in units:
        to_float32(unit)
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    to_float32(model)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum over processes, not a mean
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no pre-scaled sum)


def shard_frozen(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Shard a model that only runs forward (the teacher) in place over the process group, in its own dtype: each of
    ``units`` (the decoder layers) gathered for its forward and freed after it; the root (embeddings, final norm,
    head) stays gathered once its first forward has run. Every process must run the same forwards in step (the
    sharded student's loop pads its micro-batches so they do), and hold the same weights."""
    from torch.distributed.fsdp import fully_shard

    mesh = _process_mesh(model)
    model.requires_grad_(False)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm of sharded gradients (a DTensor) as the plain tensor every process agrees on."""
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (the tensor itself when it is not sharded)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This process's shards of ``model``'s weights (``"model"``) and of ``optimizer``'s state (``"optimizer"``), by
    weight name, as sharded tensors on their device (nothing gathered): what a sharded checkpoint writes, and what it
    is read back into. An optimizer that has not stepped gets its state made first (a step of learning rate 0)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, state = get_state_dict(model, optimizer)
    return {"model": weights, "optimizer": state}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, shards: dict[str, Any]) -> None:
    """Put ``shards`` (as :func:`sharded_state` made them, read back from a checkpoint) into ``model`` and
    ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])


def gather_into(sharded: nn.Module, skeleton: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``skeleton`` (:func:`meta_skeleton` of the model before sharding) holding the trained weights of ``sharded``
    in ``dtype``, on every process: one weight gathered at a time, so the float32 model is never whole."""
    aliases: dict[int, list[str]] = {}
    targets: dict[int, nn.Parameter] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        targets[id(param)] = param
    by_name = {name: key for key, names in aliases.items() for name in names}
    for name, param in sharded.named_parameters():
        key = by_name[name]
        full = param.detach()
        full = full.full_tensor() if hasattr(full, "full_tensor") else full
        weight = nn.Parameter(full.to(dtype), requires_grad=targets[key].requires_grad)
        for alias in aliases[key]:
            owner, _, attr = alias.rpartition(".")
            setattr(skeleton.get_submodule(owner), attr, weight)
    left = [name for name, p in skeleton.named_parameters() if p.is_meta]
    if left:
        raise SlimkitError(f"sharding: {len(left)} weights were not gathered back ({', '.join(left[:3])})")
    return skeleton


__all__ = [
    "full_norm",
    "gather_into",
    "load_sharded_state",
    "local",
    "meta_skeleton",
    "shard_frozen",
    "shard_model",
    "sharded_state",
    "to_float32",
]
