"""Mixture-of-experts knowledge as data: where a decoder layer's router and fused experts live, and the config keys.

In transformers 5 the routed experts of a layer are one module holding fused tensors: ``gate_up_proj``
``(experts, 2 x width, hidden)`` (gate rows first, then up rows) and ``down_proj`` ``(experts, hidden, width)``; the
router ``mlp.gate`` holds ``weight`` ``(experts, hidden)``, softmax over the experts, top-k, and (per family) the
top-k weights renormalised to sum to one. Qwen2-MoE adds a shared expert (a dense gated MLP) with a sigmoid gate,
which every token uses and no expert removal touches. Attention and norms are those of the dense relative
(:data:`slimkit.primitives.arch.spec.ARCH_SPECS` holds one spec per MoE ``model_type`` with ``experts`` set).

:class:`MoEBlock` is a view of one layer's MoE MLP: widths read from the tensors (never the config, which holds the
dense values until save), and :meth:`MoEBlock.sync_counts` writes the run-time attributes the router and experts
read (``num_experts``, ``top_k``). Method note: ``docs/methods/moe-experts.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.primitives.errors import SlimkitError


@dataclass(frozen=True)
class MoESpec:
    """What a mixture-of-experts family adds to its dense relative's :class:`ArchSpec`."""

    model_type: str
    moe: str
    """The MoE MLP module, relative to the layer."""
    router: str
    """The router (``weight`` ``(experts, hidden)``), relative to the layer."""
    experts: str
    """The fused experts (``gate_up_proj``, ``down_proj``), relative to the layer."""
    count_key: str
    """Config key of the routed expert count as the config stores it (``num_local_experts`` for Mixtral and
    Qwen3-MoE, whose configs map ``num_experts`` onto it; ``num_experts`` for Qwen2-MoE and OLMoE)."""
    width_key: str
    """Config key of one expert's width."""
    top_k_key: str = "num_experts_per_tok"
    norm_topk_key: str | None = "norm_topk_prob"
    """Config key saying whether the top-k weights are renormalised; None: always renormalised (Mixtral)."""
    shared_expert: str | None = None
    """The shared expert every token uses (Qwen2-MoE), relative to the layer; None when there is none."""
    shared_expert_gate: str | None = None
    """Its sigmoid gate ``Linear(hidden, 1)``, relative to the layer."""
    gguf_arch: str | None = None
    """llama.cpp's architecture name for a GGUF of this family; None when slimkit writes none."""
    hub_moe: str = "mlp"
    """The MoE MLP's name in the hub's checkpoint layout (Mixtral: ``block_sparse_moe``)."""
    hub_expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down Linear in the hub's per-expert layout (``experts.{e}.<name>.weight``)."""

    @property
    def arch(self) -> ArchSpec:
        """The attention / norm layout (the dense relative's, with ``experts`` set)."""
        return ARCH_SPECS[self.model_type]

    def renormalises(self, config: Any) -> bool:
        """Whether the top-k routing weights are renormalised to sum to one after the top-k."""
        return True if self.norm_topk_key is None else bool(getattr(config, self.norm_topk_key))


_COMMON: dict[str, Any] = dict(moe="mlp", router="mlp.gate", experts="mlp.experts")

MOE_SPECS: dict[str, MoESpec] = {
    "mixtral": MoESpec(
        "mixtral",
        count_key="num_local_experts",
        width_key="intermediate_size",
        norm_topk_key=None,
        gguf_arch="llama",  # llama.cpp runs Mixtral as llama with experts
        hub_moe="block_sparse_moe",
        hub_expert=("w1", "w3", "w2"),
        **_COMMON,
    ),
    "qwen2_moe": MoESpec(
        "qwen2_moe",
        count_key="num_experts",
        width_key="moe_intermediate_size",
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
        gguf_arch="qwen2moe",
        **_COMMON,
    ),
    "qwen3_moe": MoESpec(
        "qwen3_moe", count_key="num_local_experts", width_key="moe_intermediate_size", gguf_arch="qwen3moe", **_COMMON
    ),
    "olmoe": MoESpec("olmoe", count_key="num_experts", width_key="intermediate_size", gguf_arch="olmoe", **_COMMON),
    # Hybrids (primitives/arch/layer_kinds.py) whose MLP is routed experts beside a sigmoid-gated shared expert, as
    # Qwen2-MoE's: Qwen 3.5's MoE variant always renormalises its top-k weights, Qwen3-Next as its config says.
    "qwen3_5_moe_text": MoESpec(
        "qwen3_5_moe_text",
        count_key="num_experts",
        width_key="moe_intermediate_size",
        norm_topk_key=None,
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
        gguf_arch="qwen35moe",
        **_COMMON,
    ),
    "qwen3_next": MoESpec(
        "qwen3_next",
        count_key="num_experts",
        width_key="moe_intermediate_size",
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
        gguf_arch="qwen3next",
        **_COMMON,
    ),
}
"""MoE families by ``model_type``."""


def moe_spec(model: nn.Module) -> MoESpec | None:
    """The model's :class:`MoESpec`, or None for a dense model."""
    return MOE_SPECS.get(getattr(getattr(model, "config", None), "model_type", None) or "")


def check_all_sparse(config: Any) -> None:
    """Refuse (one line) a Qwen-MoE config with dense MLP layers among its MoE ones (``mlp_only_layers``,
    ``decoder_sparse_step`` above 1): slimkit's expert units assume every decoder layer routes."""
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise SlimkitError(
            f"{config.model_type}: layers with a dense MLP among the MoE layers (mlp_only_layers {dense}, "
            f"decoder_sparse_step {step}) are not supported; allowed: every layer a MoE layer"
        )


_WHOLE_WIDTH_QK_NORMS = ("olmoe",)
"""MoE families whose q/k norms act on the whole projection (not per head): heads cannot be removed alone."""


def role_refusal(model: nn.Module, stage: str, roles: frozenset[str] | set[str]) -> str | None:
    """Why ``stage``, which needs the projection ``roles`` as plain Linear modules, cannot run on this MoE model
    (one line), or None (also for every dense model)."""
    spec = moe_spec(model)
    if spec is None:
        return None
    mlp = sorted(set(roles) & {"gate", "up", "down"})
    if mlp:
        return (
            f"{stage}: {spec.model_type} holds its MLP as routed experts (fused tensors, no {'/'.join(mlp)} "
            "projections); remove whole experts with prune_experts or merge_experts"
        )
    attention = sorted(set(roles) & {"q", "k", "v", "o"})
    if attention and spec.model_type in _WHOLE_WIDTH_QK_NORMS:
        return (
            f"{stage}: {spec.model_type}'s q/k norms act on the whole projection, not per head, so its attention "
            f"projections ({'/'.join(attention)}) are not changed by slimkit; remove whole experts instead"
        )
    return None


class MoEBlock:
    """One decoder layer's MoE MLP: its router, its fused experts, widths read from their tensors."""

    def __init__(self, index: int, layer: nn.Module, spec: MoESpec, config: Any) -> None:
        self.index = index
        self.layer = layer
        self.spec = spec
        self.config = config

    @property
    def module(self) -> nn.Module:
        return self.layer.get_submodule(self.spec.moe)

    @property
    def router(self) -> nn.Module:
        return self.layer.get_submodule(self.spec.router)

    @property
    def experts(self) -> nn.Module:
        return self.layer.get_submodule(self.spec.experts)

    @property
    def num_experts(self) -> int:
        return int(self.router.weight.shape[0])

    @property
    def width(self) -> int:
        """One expert's width (``down_proj``'s input columns)."""
        return int(self.experts.down_proj.shape[-1])

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)

    @property
    def renormalises(self) -> bool:
        return self.spec.renormalises(self.config)

    @property
    def activation(self) -> Any:
        return self.experts.act_fn

    @property
    def shared_expert(self) -> nn.Module | None:
        return None if self.spec.shared_expert is None else self.layer.get_submodule(self.spec.shared_expert)

    def expert_params(self) -> int:
        """Parameters of one routed expert (its gate/up and down slices) plus its router row."""
        hidden = int(self.router.weight.shape[1])
        return 3 * hidden * self.width + hidden

    def sync_counts(self) -> None:
        """Write the expert count into the attributes the router and experts read at run time."""
        count = self.num_experts
        if int(self.experts.gate_up_proj.shape[0]) != count or int(self.experts.down_proj.shape[0]) != count:
            raise ValueError(f"layer {self.index}: router rows and fused expert tensors disagree on the expert count")
        for module in (self.router, self.experts, self.module):
            if hasattr(module, "num_experts"):
                module.num_experts = count  # type: ignore[assignment]  # an int attribute torch types as Module

    def widths(self) -> dict[str, int]:
        """Config entries of this layer's MoE MLP (expert count and width)."""
        return {self.spec.count_key: self.num_experts, self.spec.width_key: self.width}


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every decoder layer's :class:`MoEBlock` (a layer whose MLP was removed gives none)."""
    spec = moe_spec(model)
    if spec is None:
        raise SlimkitError(
            f"model_type '{getattr(model.config, 'model_type', None)}' has no routed experts; "
            f"expert units need one of: {', '.join(MOE_SPECS)}"
        )
    layers = model.base_model.get_submodule(spec.arch.layers)
    blocks = []
    for index, layer in enumerate(layers):
        try:
            layer.get_submodule(spec.experts)
        except AttributeError:
            continue
        blocks.append(MoEBlock(index, layer, spec, model.config))
    return blocks


def layer_moe_widths(layer: nn.Module, model_type: str) -> dict[str, int] | None:
    """The expert count and width entries of one layer (None for a dense family; zero experts and width for a MoE
    layer whose whole MLP block was removed)."""
    spec = MOE_SPECS.get(model_type)
    if spec is None:
        return None
    try:
        router = layer.get_submodule(spec.router)
        experts = layer.get_submodule(spec.experts)
    except AttributeError:
        return {spec.count_key: 0, spec.width_key: 0}
    return {spec.count_key: int(router.weight.shape[0]), spec.width_key: int(experts.down_proj.shape[-1])}


def fused_expert_shapes(model_type: str | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a checkpoint as the model holds them: the hub's per-expert tensors (``experts.{e}.gate_proj``
    ...) as the fused ``experts.gate_up_proj`` ``(E, 2I, H)`` and ``experts.down_proj`` ``(E, H, I)`` that
    transformers builds from them on loading (its checkpoint conversion); other names unchanged."""
    spec = MOE_SPECS.get(model_type or "")
    if spec is None:
        return shapes
    gate, up, down = spec.hub_expert
    expert = re.compile(
        rf"^(?P<layer>.*\.)(?:{re.escape(spec.hub_moe)}|{re.escape(spec.moe)})\.experts\.(?P<e>\d+)\."
        rf"(?P<role>{gate}|{up}|{down})\.weight$"
    )
    moe_prefix = re.compile(rf"\.{re.escape(spec.hub_moe)}\.")
    fused: dict[str, tuple[int, ...]] = {}
    experts: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        match = expert.match(name)
        if match is None:
            fused[moe_prefix.sub(f".{spec.moe}.", name)] = shape
            continue
        experts.setdefault(match["layer"], {}).setdefault(match["role"], {})[int(match["e"])] = shape
    for layer, roles in experts.items():
        count = len(roles.get(down, {}))
        ((width, hidden),) = {roles[down][e][::-1] for e in roles[down]} or {(0, 0)}
        fused[f"{layer}{spec.experts}.gate_up_proj"] = (count, 2 * width, hidden)
        fused[f"{layer}{spec.experts}.down_proj"] = (count, hidden, width)
    return fused


def materialise_experts(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """Give each layer's router and fused experts the saved shapes (per-layer expert counts and widths) before
    the weights are loaded; the run-time counts follow."""
    spec = moe_spec(model)
    if spec is None:
        return
    prefix = {id(module): name for name, module in model.named_modules()}
    for block in moe_blocks(model):
        router_name = prefix[id(block.router)] + ".weight"
        experts_name = prefix[id(block.experts)]
        shapes = {
            (block.router, "weight"): saved.get(router_name),
            (block.experts, "gate_up_proj"): saved.get(experts_name + ".gate_up_proj"),
            (block.experts, "down_proj"): saved.get(experts_name + ".down_proj"),
        }
        for (module, name), shape in shapes.items():
            current = getattr(module, name)
            if shape is not None and tuple(current.shape) != tuple(shape):
                setattr(module, name, nn.Parameter(torch.empty(shape, dtype=current.dtype, device=current.device)))
        if all(shape is not None for shape in shapes.values()):
            block.sync_counts()


__all__ = [
    "MOE_SPECS",
    "MoEBlock",
    "MoESpec",
    "check_all_sparse",
    "fused_expert_shapes",
    "layer_moe_widths",
    "materialise_experts",
    "moe_blocks",
    "moe_spec",
    "role_refusal",
]
