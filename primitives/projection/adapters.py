"""`BasisChange`: a residual matrix (SP3 Eq. 18) carried by hooks, never by a copied forward pass.

Attached to the first decoder layer of a group, it maps the residual stream from the previous group's basis to the
new one.

Method note: docs/methods/sp3-residual-matrix.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

KIND = "basis_change"
NAME = "basis_change"
Hook = Literal["input", "output", "residual", "branch"]
HELD = "_basis_change_held"


class BasisChange(nn.Module):
    """``y = W x (+ b)`` from ``in_features`` to ``out_features`` (a residual / basis-change matrix)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        hook: Hook = "input",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        writer: str | None = None,
    ) -> None:
        super().__init__()
        if (hook == "branch") != (writer is not None):
            raise ValueError("a 'branch' basis change needs its writer's path (and only it has one)")
        self.writer = writer
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.hook = hook

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        writer = f", writer={self.writer}" if self.writer else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, hook={self.hook}{writer}"

    def manifest_entry(self, path: str) -> dict[str, Any]:
        return {
            "path": path,
            "kind": KIND,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
            "hook": self.hook,
        } | ({"writer": self.writer} if self.writer else {})


def _map_input(host: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    adapter = host._modules[NAME]
    if args:
        return (adapter(args[0]), *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = adapter(kwargs["hidden_states"])
    return args, kwargs


def _map_residual(host: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    adapter = host._modules[NAME]
    if len(args) >= 2:
        return (args[0], adapter(args[1]), *args[2:]), kwargs
    kwargs = dict(kwargs)
    kwargs["input_tensor"] = adapter(kwargs["input_tensor"])
    return args, kwargs


def _map_output(host: nn.Module, _args: tuple, output: Any) -> Any:
    adapter = host._modules[NAME]
    if isinstance(output, tuple):
        return (adapter(output[0]), *output[1:])
    return adapter(output)


def _hold_branch(writer: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    writer.__dict__[HELD] = output
    return output.new_zeros(())


def _map_branch(host: nn.Module, _args: tuple, output: Any) -> Any:
    adapter = host._modules[NAME]
    held = host.get_submodule(adapter.writer).__dict__.pop(HELD, None)
    if held is None:
        raise RuntimeError(f"{type(host).__name__}: the branch basis change found no output of {adapter.writer}")
    stream = output[0] if isinstance(output, tuple) else output
    mapped = adapter(stream) + held.reshape(*stream.shape[:-1], held.shape[-1])  # OPT's fc2 sees (tokens, d)
    return (mapped, *output[1:]) if isinstance(output, tuple) else mapped


_HOOKS = (_map_input, _map_output, _map_residual, _map_branch)


def _has_hook(host: nn.Module) -> bool:
    hooks = [*host._forward_pre_hooks.values(), *host._forward_hooks.values()]
    return any(h in _HOOKS for h in hooks)


def attach_basis_change(
    host: nn.Module,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    hook: Hook = "input",
    writer: str | None = None,
) -> BasisChange:
    """Attach ``W`` (``out x in``) to ``host``: on its input ``hidden_states``, its output, (``"residual"``)
    its second argument ``input_tensor``, or (``"branch"``, with ``writer`` the path of the host's last
    writer) the residual branch of its sum (see the module docstring).

    The tensors are copied (dtype and device follow the host's parameters). A host holds at most
    one adapter; attaching to a host that has one raises ``ValueError``.
    """
    if NAME in host._modules or _has_hook(host):
        raise ValueError(f"{type(host).__name__} already carries a basis change")
    reference = next(iter(host.parameters()), weight)
    adapter = BasisChange(
        weight.shape[1],
        weight.shape[0],
        bias is not None,
        hook,
        device=reference.device,
        dtype=reference.dtype,
        writer=writer,
    )
    with torch.no_grad():
        adapter.weight.copy_(weight)
        if bias is not None:
            adapter.bias.copy_(bias)
    _install(host, adapter)
    return adapter


def _install(host: nn.Module, adapter: BasisChange) -> None:
    host.add_module(NAME, adapter)
    if adapter.hook == "input":
        host.register_forward_pre_hook(_map_input, with_kwargs=True)
    elif adapter.hook == "residual":
        host.register_forward_pre_hook(_map_residual, with_kwargs=True)
    elif adapter.hook == "branch":
        host.get_submodule(adapter.writer).register_forward_hook(_hold_branch)
        host.register_forward_hook(_map_branch)
    else:
        host.register_forward_hook(_map_output)


def basis_changes(model: nn.Module) -> list[tuple[str, BasisChange]]:
    """Every attached :class:`BasisChange` with its path, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BasisChange)]


def basis_change_params(model: nn.Module) -> int:
    """Parameters held by residual / basis-change matrices (SP3 Table 9's "+ 0.01B")."""
    return sum(p.numel() for _name, m in basis_changes(model) for p in m.parameters())


def basis_change_entries(model: nn.Module) -> list[dict[str, Any]]:
    return [m.manifest_entry(name) for name, m in basis_changes(model)]


def materialise_basis_changes(model: nn.Module, entries: Iterable[dict[str, Any]]) -> int:
    """Attach an empty adapter for each ``basis_change`` entry (others are skipped); returns the count."""
    count = 0
    for entry in entries:
        if entry.get("kind") != KIND:
            continue
        host_path, _, name = entry["path"].rpartition(".")
        if name != NAME:
            raise ValueError(f"basis change entry at unexpected path {entry['path']!r}")
        host = model.get_submodule(host_path)
        reference = next(iter(host.parameters()), None)
        adapter = BasisChange(
            int(entry["in_features"]),
            int(entry["out_features"]),
            bool(entry.get("bias", False)),
            entry.get("hook", "input"),
            device=None if reference is None else reference.device,
            dtype=None if reference is None else reference.dtype,
            writer=entry.get("writer"),
        )
        _install(host, adapter)
        count += 1
    return count


__all__ = [
    "HELD",
    "KIND",
    "BasisChange",
    "attach_basis_change",
    "basis_change_entries",
    "basis_change_params",
    "basis_changes",
    "materialise_basis_changes",
]
