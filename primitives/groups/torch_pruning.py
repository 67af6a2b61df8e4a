"""Coupling groups from torch-pruning's ``DependencyGraph``, for models with no slimkit adapter.

:func:`dependency_graph_groups` traces the model once and turns torch-pruning's dependency groups into slimkit
:class:`~slimkit.primitives.groups.Group` s.

Method note: docs/methods/groups.md.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch_pruning as tp
from torch import nn

from slimkit.primitives.groups import Group, Member

DEPENDENCY_KIND = "dependency"

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")
_MLP_INPUT_NAMES = {
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "fc1",
    "w1",
    "w3",
    "c_fc",
    "wi",
    "wi_0",
    "wi_1",
    "dense_h_to_4h",
    "lin1",
}
_MLP_SCOPES = {"mlp", "ffn", "feed_forward", "feedforward", "intermediate"}
_ROTARY_NAME = "apply_rotary_pos_emb"


class DependencyGroupError(ValueError):
    """A torch-pruning group that cannot be expressed as a slimkit :class:`Group`."""


def dependency_graph_groups(
    model: nn.Module,
    example_inputs: torch.Tensor | dict,
    root_modules: Iterable[str | nn.Module] | None = None,
    *,
    ignored_modules: Iterable[str | nn.Module] | None = None,
    forward_fn: Callable[[nn.Module, torch.Tensor | dict], torch.Tensor] | None = None,
    strict: bool = False,
) -> list[Group]:
    """One Group per torch-pruning pruning group rooted at an ``nn.Linear`` output dimension.

    ``root_modules``: module paths (or modules) whose output channels root a group, in order; by default
    every ``nn.Linear`` in module order except the output head (``get_output_embeddings()``). A root
    whose output channels already belong to an earlier group is skipped (as in ``get_all_groups``), so
    gate and up give one MLP group. ``ignored_modules`` are left out of the trace altogether.
    ``forward_fn(model, example_inputs)`` must return one tensor; by default the model is called with the
    inputs (``**`` for a dict) and the logits / last hidden state / first tensor of its output is used.
    Groups torch-pruning gets wrong (see the module docstring: attention under GQA) are skipped with a
    warning, or raise :class:`DependencyGroupError` when ``strict``.
    """
    names = {module: name for name, module in model.named_modules()}
    modules = dict(model.named_modules())

    def resolve(items: Iterable[str | nn.Module]) -> list[nn.Module]:
        return [modules[item] if isinstance(item, str) else item for item in items]

    ignored = resolve(ignored_modules or [])
    if root_modules is None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        roots = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head and m not in ignored]
    else:
        roots = resolve(root_modules)
        for root in roots:
            if not isinstance(root, nn.Linear):
                raise TypeError(f"root module {names.get(root, root)!r} is not an nn.Linear")

    graph = _build_graph(model, example_inputs, forward_fn or _default_forward, ignored)
    param_names = _canonical_param_names(model)
    groups: list[Group] = []
    skipped: list[str] = []
    covered: set[int] = set()  # modules whose output channels already lie in a group
    for root in roots:
        if id(root) in covered or root not in graph.module2node:
            continue
        tp_group = graph.get_pruning_group(root, tp.prune_linear_out_channels, list(range(root.out_features)))
        for item in tp_group:
            if graph.is_out_channel_pruning_fn(item.dep.handler) and isinstance(item.dep.target.module, nn.Module):
                covered.add(id(item.dep.target.module))
        try:
            groups.append(_convert(graph, tp_group, names[root], names, param_names))
        except DependencyGroupError as err:
            if strict:
                raise
            skipped.append(f"{names[root]}: {err}")
    if skipped:
        warnings.warn(
            "torch-pruning groups skipped, not expressible as slimkit groups (e.g. attention under grouped-query "
            "attention: use build_groups; projections fused and split with chunk): " + "; ".join(skipped),
            stacklevel=2,
        )
    return groups


def _default_forward(model: nn.Module, inputs: torch.Tensor | dict) -> torch.Tensor:
    from slimkit.primitives.device.moves import to_input_device

    inputs = to_input_device(model, inputs)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    values = out.values() if isinstance(out, dict) else out
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find an output tensor in {type(out).__name__}; pass forward_fn")


def _identity_rotary(q, k, *args, **kwargs):
    return q, k


@contextmanager
def _rotary_as_identity(model: nn.Module) -> Iterator[None]:
    """Replace ``apply_rotary_pos_emb`` by an identity in every module defining one of the model's classes."""
    restore: list[Callable[[], None]] = []
    seen: set[str] = set()
    for module in model.modules():
        source = sys.modules.get(type(module).__module__)
        if source is not None and source.__name__ not in seen:
            seen.add(source.__name__)
            original = getattr(source, _ROTARY_NAME, None)
            if callable(original):
                setattr(source, _ROTARY_NAME, _identity_rotary)
                restore.append(lambda _s=source, _f=original: setattr(_s, _ROTARY_NAME, _f))
        hidden = module.__dict__.get("_hidden_kernels")
        if isinstance(hidden, dict) and _ROTARY_NAME in hidden:
            original = hidden[_ROTARY_NAME]
            hidden[_ROTARY_NAME] = _identity_rotary
            restore.append(lambda _h=hidden, _f=original: _h.__setitem__(_ROTARY_NAME, _f))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _build_graph(model, example_inputs, forward_fn, ignored) -> tp.DependencyGraph:
    """Trace with RoPE as identity, gradients on and every parameter requiring grad; restore all after."""
    training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for param, _ in flags:
            param.requires_grad_(True)
        with _rotary_as_identity(model), torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tp.DependencyGraph().build_dependency(
                model, example_inputs, forward_fn=forward_fn, ignored_layers=list(ignored), verbose=False
            )
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)
        model.train(training)


def _canonical_param_names(model: nn.Module) -> dict[int, tuple[int, str, str]]:
    """Parameter identity -> (order, module path, name), a tied parameter under its first name."""
    out: dict[int, tuple[int, str, str]] = {}
    for order, (name, param) in enumerate(model.named_parameters()):
        module, _, pname = name.rpartition(".")
        out.setdefault(id(param), (order, module, pname))
    return out


def _targets(graph, item) -> list[tuple[nn.Parameter, int]]:
    """(parameter, dimension) pairs one torch-pruning group item prunes."""
    target = item.dep.target.module
    out_fn = graph.is_out_channel_pruning_fn(item.dep.handler)
    if isinstance(target, nn.Parameter):
        return [(target, item.dep.target.pruning_dim % target.dim())]
    if isinstance(target, nn.Linear):
        if out_fn:
            return [(target.weight, 0)] + ([(target.bias, 0)] if target.bias is not None else [])
        return [(target.weight, 1)]
    if isinstance(target, nn.Embedding):
        return [(target.weight, 1)]
    if isinstance(target, nn.LayerNorm):
        return [(p, p.dim() - 1) for p in (target.weight, target.bias) if p is not None]
    if isinstance(target, nn.Module) and any(True for _ in target.parameters(recurse=False)):
        raise DependencyGroupError(f"unsupported module type {type(target).__name__}")
    return []  # operations (reshape, add, ...) and parameter-free modules


def _convert(graph, tp_group, root_name: str, names, param_names) -> Group:
    root_idxs = list(tp_group[0].root_idxs)
    units = sorted(set(root_idxs))
    unit_of = {r: u for u, r in enumerate(units)}
    mapped = any(m is not None for item in tp_group for m in item.dep.index_mapping)
    positions: dict[tuple[int, int], dict[int, list[int]]] = {}
    params: dict[tuple[int, int], nn.Parameter] = {}
    embedding = False
    for item in tp_group:
        targets = _targets(graph, item)
        embedding |= isinstance(item.dep.target.module, nn.Embedding)
        for param, dim in targets:
            key = (id(param), dim)
            params[key] = param
            slots = positions.setdefault(key, {})
            for idx, root in zip(item.idxs, item.root_idxs, strict=True):
                if root is None or root not in unit_of:
                    raise DependencyGroupError("a position lost its root index (GQA index mapping)")
                slot = slots.setdefault(unit_of[root], [])
                if idx not in slot:
                    slot.append(int(idx))
    members: list[tuple[int, int, Member]] = []
    for key, slots in positions.items():
        param, dim = params[key], key[1]
        if id(param) not in param_names:
            raise DependencyGroupError("a pruned parameter is not a parameter of the model")
        order, module, pname = param_names[id(param)]
        members.append((order, dim, Member(module, pname, dim, _index_matrix(slots, len(units), param, dim, mapped))))
    members.sort(key=lambda entry: entry[:2])
    group_members = tuple(member for _, _, member in members)
    layer = _common_layer([m.module for m in group_members])
    kind = "hidden_feature" if embedding else _kind(graph, tp_group, names, layer)
    return Group(kind, layer, group_members, {"root": root_name, "source": "torch_pruning"})


def _index_matrix(slots: dict[int, list[int]], units: int, param, dim: int, mapped: bool) -> torch.Tensor:
    size = param.shape[dim]
    widths = {len(slots.get(u, ())) for u in range(units)}
    if len(widths) != 1 or 0 in widths:
        raise DependencyGroupError(f"units occupy unequal numbers of positions along dim {dim} of {tuple(param.shape)}")
    matrix = torch.tensor([sorted(slots[u]) for u in range(units)], dtype=torch.long)
    flat = matrix.flatten()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= size):
        raise DependencyGroupError(f"positions beyond dim {dim} of a {tuple(param.shape)} parameter")
    if flat.unique().numel() != flat.numel():
        raise DependencyGroupError("two units share a position")
    if not mapped and flat.numel() != size:
        raise DependencyGroupError(
            f"{flat.numel()} of {size} positions along dim {dim} of a {tuple(param.shape)} parameter "
            "coupled one to one with the root (dimensions of different widths, e.g. grouped-query attention)"
        )
    return matrix


def _common_layer(paths: list[str]) -> int | None:
    layers = set()
    for path in paths:
        match = _LAYER_RE.search(path)
        layers.add(int(match.group(1)) if match else None)
    return layers.pop() if len(layers) == 1 else None


def _kind(graph, tp_group, names, layer: int | None) -> str:
    if layer is None:
        return DEPENDENCY_KIND
    outputs, inputs = [], []
    for item in tp_group:
        target = item.dep.target.module
        if isinstance(target, nn.Linear):
            (outputs if graph.is_out_channel_pruning_fn(item.dep.handler) else inputs).append(names[target])
        elif isinstance(target, nn.Parameter) or not _is_operation(target):
            return DEPENDENCY_KIND  # norms, embeddings, ... inside the group: not an MLP channel
    if len(set(inputs)) != 1 or not outputs:
        return DEPENDENCY_KIND
    for path in outputs:
        parts = path.split(".")
        if parts[-1] not in _MLP_INPUT_NAMES and not _MLP_SCOPES.intersection(parts[:-1]):
            return DEPENDENCY_KIND
    return "mlp_channel"


def _is_operation(target) -> bool:
    return isinstance(target, nn.Module) and type(target).__module__.startswith("torch_pruning")


__all__ = ["DEPENDENCY_KIND", "DependencyGroupError", "dependency_graph_groups"]
