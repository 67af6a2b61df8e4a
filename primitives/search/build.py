"""Building a candidate from its parent sub-block, and applying a built one: the block library's surgery.

Each candidate is made by the primitives the stages use (``prune_layer``'s Wanda-scored heads, KV groups and MLP
channels with ``reconstruct``'s least-squares refit of their consumer; ``lowrank``'s AWSVD at LoRAP's split with each
left factor refit; ``prune_experts``' most-picked experts; ``remove_blocks``' stand-in), on a copy of the parent put in
its place (:func:`parent_kept`), from the dense layer's statistics. A built candidate is a
:class:`~.record.CandidateRecord`; :func:`apply_record` redoes the surgery with its indices or ranks and loads its
tensors, so applying a record gives bit for bit the sub-block that was built.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.moe import MoEBlock, moe_blocks, moe_spec
from slimkit.primitives.arch.view import BLOCK_ROLES, LinearRole
from slimkit.primitives.blocks import Block, remove_block
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.experts.surgery import keep_experts
from slimkit.primitives.groups import layer_group
from slimkit.primitives.importance import score_group
from slimkit.primitives.lowrank import LowRankLinear, allocate_attention, dense_params, max_useful_rank, rank_for_budget
from slimkit.primitives.reconstruct.consumer import DenseConsumer
from slimkit.primitives.reconstruct.refit import RefitSettings, refit_lowrank_left, refit_role
from slimkit.primitives.search.candidates import UNIT_KINDS, CandidateSpec, Part
from slimkit.primitives.search.record import CandidateRecord
from slimkit.primitives.select.plan import SelectionRules, keep_indices
from slimkit.primitives.surgery import remove_units
from slimkit.primitives.surgery.units import sync_config

CONSUMER: dict[str, LinearRole] = {"heads": "o", "kv_groups": "o", "channels": "down"}
"""The projection that reads a unit kind's outputs (refit after removal)."""


@dataclass(frozen=True)
class BuildSettings:
    """How candidates are refit and factored (part of every candidate's key)."""

    damping: float = 0.1
    """Ridge damping of the least-squares refits, as a fraction of the mean diagonal of the kept inputs' Gram."""
    toward: Literal["zero", "kept"] = "kept"
    """What the ridge pulls towards (reconstruct's ``toward``)."""
    qk_share: float = 0.25
    """LoRAP's share of an attention low-rank budget for q + k."""
    mac_fraction: float = 0.75
    """No factorisation costs more than this fraction of the dense MACs."""

    def refit(self) -> RefitSettings:
        return RefitSettings(damping=self.damping, toward=self.toward)


@dataclass(frozen=True)
class LayerEvidence:
    """What the builder reads of one dense layer: every projection's input norms (by model path), the dense
    consumers of the roles it refits (by role), and the expert pick counts of a MoE layer."""

    input_norms: Mapping[str, torch.Tensor]
    consumers: Mapping[str, DenseConsumer]
    expert_counts: torch.Tensor | None = None

    def consumer(self, role: str) -> DenseConsumer:
        if role not in self.consumers:
            raise SlimkitError(f"search: no dense statistics of {role} were gathered to refit it")
        return self.consumers[role]


def part_paths(layer: LayerView, part: Part) -> tuple[str, ...]:
    """The modules one sub-block holds, relative to the layer: the block and its norms."""
    block = layer.spec.attention if part == "attention" else layer.spec.mlp
    if block is None:
        raise SlimkitError(f"{layer.spec.model_type} layers have no {part} block")
    return (block, *layer.spec.block_norms(part))


def part_state(layer: LayerView, part: Part) -> dict[str, torch.Tensor]:
    """The sub-block's parameters and persistent buffers by name relative to the layer (cloned, detached)."""
    state: dict[str, torch.Tensor] = {}
    for path in part_paths(layer, part):
        for name, tensor in layer.module.get_submodule(path).state_dict().items():
            state[f"{path}.{name}"] = tensor.detach().clone()
    return state


def _part_bytes(layer: LayerView, part: Part) -> int:
    return sum(t.numel() * t.element_size() for t in part_state(layer, part).values())


@contextmanager
def parent_kept(model: nn.Module, index: int, part: Part) -> Iterator[LayerView]:
    """Inside: layer ``index``'s sub-block is a copy of itself (change it freely); after: the parent's own modules are
    back, with the model's head counts and config widths as they were."""
    layer = ModelView(model).layer(index)
    paths = part_paths(layer, part)
    parents = [layer.module.get_submodule(path) for path in paths]
    for path, module in zip(paths, parents, strict=True):
        layer.module.set_submodule(path, copy.deepcopy(module))
    try:
        yield ModelView(model).layer(index)
    finally:
        for path, module in zip(paths, parents, strict=True):
            layer.module.set_submodule(path, module)
        layer = ModelView(model).layer(index)
        layer.sync_head_counts()
        if part == "mlp" and is_moe_layer(model, index):
            _moe_block(model, index).sync_counts()
        sync_config(model)


def is_moe_layer(model: nn.Module, index: int) -> bool:
    """Whether layer ``index`` has routed experts."""
    return moe_spec(model) is not None and any(block.index == index for block in moe_blocks(model))


def _moe_block(model: nn.Module, index: int) -> MoEBlock:
    blocks = [block for block in moe_blocks(model) if block.index == index]
    if not blocks:
        raise SlimkitError(f"layer {index} has no routed experts")
    return blocks[0]


def lowrank_ranks(layer: LayerView, part: Part, kept: float, settings: BuildSettings) -> dict[str, int | None]:
    roles = [role for role in BLOCK_ROLES[part] if role in layer.roles]
    shapes: dict[str, tuple[int, int]] = {}
    for linear_role in roles:
        d_out, d_in = layer.linear(linear_role).weight.shape
        shapes[linear_role] = (int(d_out), int(d_in))
    if part == "attention" and sorted(roles) == ["k", "o", "q", "v"]:
        budget = int(kept * sum(dense_params(d_in, d_out) for d_out, d_in in shapes.values()))
        return allocate_attention(shapes, budget, settings.qk_share, settings.mac_fraction)
    ranks: dict[str, int | None] = {}
    for role, (d_out, d_in) in shapes.items():
        cap = max_useful_rank(d_in, d_out, settings.mac_fraction)
        budget = int(kept * dense_params(d_in, d_out))
        ranks[role] = min(rank_for_budget(d_in, d_out, budget), cap) if cap >= 1 else None
    return ranks


def reshape(model: nn.Module, index: int, spec: CandidateSpec, structure: Mapping[str, Any]) -> None:
    """Give layer ``index``'s (dense) sub-block the candidate's structure; the values are the parent's until the
    record's tensors are loaded (or the builder refits them)."""
    view = ModelView(model)
    layer = view.layer(index)
    if spec.kind == "removed":
        remove_block(model, Block(index, spec.part))
    elif spec.kind in UNIT_KINDS:
        remove_units(model, layer_group(model, UNIT_KINDS[spec.kind], index), list(structure["kept"]))
    elif spec.kind == "experts":
        keep_experts(_moe_block(model, index), list(structure["kept"]))
    elif spec.kind == "lowrank":
        for role, rank in structure["ranks"].items():
            if rank is None:
                continue
            linear = cast(nn.Linear, layer.linear(role))
            weight = linear.weight
            layer.set_linear(
                role,
                LowRankLinear(
                    linear.in_features,
                    linear.out_features,
                    int(rank),
                    bias=linear.bias is not None,
                    device=weight.device,
                    dtype=weight.dtype,
                ),
            )
        sync_config(model)


def timing_structure(model: nn.Module, index: int, spec: CandidateSpec, settings: BuildSettings) -> dict[str, Any]:
    """A structure of ``spec``'s shapes for layer ``index`` that needs no statistics (the first units of each KV
    group, the first experts): what a latency probe times, whose values do not matter."""
    layer = ModelView(model).layer(index)
    if spec.kind in UNIT_KINDS:
        group = layer_group(model, UNIT_KINDS[spec.kind], index)
        count = int(cast(float, spec.kept))
        return {
            "kept": [int(i) for i in keep_indices(group, torch.zeros(group.size), count, SelectionRules()).tolist()]
        }
    if spec.kind == "experts":
        return {"kept": list(range(int(cast(float, spec.kept))))}
    if spec.kind == "lowrank":
        return {"ranks": lowrank_ranks(layer, spec.part, float(cast(float, spec.kept)), settings)}
    return {}


def _change(
    model: nn.Module, index: int, spec: CandidateSpec, evidence: LayerEvidence, settings: BuildSettings
) -> dict[str, Any] | None:
    """Make and refit the candidate on the copy in place; its structure, or None when it equals the parent."""
    layer = ModelView(model).layer(index)
    if spec.kind == "removed":
        reshape(model, index, spec, {})
        return {}
    if spec.kind in UNIT_KINDS:
        group = layer_group(model, UNIT_KINDS[spec.kind], index)
        scores = score_group("activation", group, model, {"input_norms": evidence.input_norms}, aggregation="l2")
        kept = keep_indices(group, scores, int(cast(float, spec.kept)), SelectionRules())
        structure = {"kept": [int(i) for i in kept.tolist()]}
        reshape(model, index, spec, structure)
        role = CONSUMER[spec.kind]
        refit_role(ModelView(model).layer(index), role, evidence.consumer(role), settings.refit())
        return structure
    if spec.kind == "experts":
        counts = evidence.expert_counts
        if counts is None:
            raise SlimkitError(f"search: layer {index}: no routing counts were gathered to choose its experts")
        order = sorted(range(counts.numel()), key=lambda e: (-float(counts[e]), e))
        structure = {"kept": sorted(order[: int(cast(float, spec.kept))])}
        reshape(model, index, spec, structure)
        return structure
    if spec.kind == "lowrank":
        ranks = lowrank_ranks(layer, spec.part, float(cast(float, spec.kept)), settings)
        if all(rank is None for rank in ranks.values()):
            return None
        for name, rank in ranks.items():
            if rank is None:
                continue
            factored = cast(LinearRole, name)
            linear = cast(nn.Linear, layer.linear(factored))
            norms = evidence.input_norms[ModelView(model).path_of(linear)]
            layer.set_linear(factored, LowRankLinear.from_linear(linear, rank, norms))
            module = cast(LowRankLinear, layer.linear(factored))
            refit_lowrank_left(layer, factored, module, evidence.consumer(factored), settings.refit())
        sync_config(model)
        return {"ranks": ranks}
    return None  # dense


def build_candidate(
    model: nn.Module, index: int, spec: CandidateSpec, evidence: LayerEvidence, settings: BuildSettings
) -> CandidateRecord | None:
    """Layer ``index``'s candidate ``spec`` built from its dense parent (see the module docstring); None when it is
    the parent itself (``dense``, or a factorisation that keeps every matrix dense)."""
    if spec.kind == "dense":
        return None
    start = time.perf_counter()
    before = params_by_part(model)
    parent = ModelView(model).layer(index)
    parent_bytes = _part_bytes(parent, spec.part)
    with parent_kept(model, index, spec.part) as layer:
        structure = _change(model, index, spec, evidence, settings)
        if structure is None:
            return None
        after = params_by_part(model)
        layer = ModelView(model).layer(index)
        tensors = part_state(layer, spec.part)
        record = CandidateRecord(
            layer=index,
            spec=spec,
            structure=structure,
            tensors=tensors,
            removed={part: before[part] - after[part] for part in before},
            removed_bytes=parent_bytes - sum(t.numel() * t.element_size() for t in tensors.values()),
            kv_heads=layer.num_kv_heads,
            head_dim=parent.head_dim if not parent.attention_removed else 0,
        )
    record.seconds = time.perf_counter() - start
    return record


def load_part(layer: LayerView, part: Part, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the sub-block's tensors of the same names and shapes (every one, and no other)."""
    present = part_state(layer, part)
    if set(present) != set(tensors):
        missing, extra = sorted(set(present) - set(tensors)), sorted(set(tensors) - set(present))
        raise SlimkitError(f"layer {layer.index} {part}: the record does not fit (missing {missing}, extra {extra})")
    with torch.no_grad():
        for name, value in tensors.items():
            target = layer.module.get_parameter(name) if _is_parameter(layer.module, name) else _buffer(layer, name)
            if target.shape != value.shape:
                raise SlimkitError(
                    f"layer {layer.index} {name}: the record holds {tuple(value.shape)}, "
                    f"the model {tuple(target.shape)}"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))


def _is_parameter(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
    except AttributeError:
        return False
    return True


def _buffer(layer: LayerView, name: str) -> torch.Tensor:
    return layer.module.get_buffer(name)


def apply_record(model: nn.Module, record: CandidateRecord) -> None:
    """Replace layer ``record.layer``'s dense sub-block by the recorded candidate (its structure, then its tensors)."""
    reshape(model, record.layer, record.spec, record.structure)
    load_part(ModelView(model).layer(record.layer), record.spec.part, record.tensors)


@contextmanager
def applied(model: nn.Module, record: CandidateRecord | None) -> Iterator[None]:
    """The model with ``record`` in place of its parent inside the ``with`` (None: the parent itself)."""
    if record is None:
        yield
        return
    with parent_kept(model, record.layer, record.spec.part):
        apply_record(model, record)
        yield


__all__ = [
    "CONSUMER",
    "BuildSettings",
    "LayerEvidence",
    "applied",
    "apply_record",
    "build_candidate",
    "is_moe_layer",
    "load_part",
    "lowrank_ranks",
    "parent_kept",
    "part_paths",
    "part_state",
    "reshape",
    "timing_structure",
]
