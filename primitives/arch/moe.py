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
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from slimkit.primitives.arch.expert_layout import ExpertLayout, RowExperts, from_rows, stored_width, to_rows
from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.primitives.errors import SlimkitError

if TYPE_CHECKING:
    from slimkit.primitives.experts.routers import Router, RouterKind


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
    hub_moe: str = "mlp"
    """The MoE MLP's name in the hub's checkpoint layout (Mixtral: ``block_sparse_moe``)."""
    hub_expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down Linear in the hub's per-expert layout (``experts.{e}.<name>.weight``)."""
    hub_per_expert: bool = True
    """The hub's checkpoints hold one tensor per expert (transformers fuses them on loading); False: fused as the
    model holds them (GPT-OSS, Llama 4)."""
    router_kind: RouterKind = "softmax"
    """How the router picks and weighs experts (:mod:`slimkit.primitives.experts.routers`)."""
    router_vectors: tuple[str, ...] = ()
    """Per-expert vectors of the router sliced with its rows: a logit bias (GPT-OSS ``bias``), a choice correction
    (DeepSeek-V3's ``e_score_correction_bias`` buffer)."""
    scale_key: str | None = None
    """Config key of the factor the chosen weights are multiplied by (``routed_scaling_factor``)."""
    groups_key: str | None = None
    """Config key of the router's expert groups (``n_group``: group-limited routing); None: one group."""
    top_groups_key: str | None = None
    """Config key of the groups a token may pick experts from (``topk_group``)."""
    expert_layout: ExpertLayout = "rows"
    """How the fused expert tensors are stored (:mod:`slimkit.primitives.arch.expert_layout`)."""
    expert_glu: Literal["act", "clamped_swiglu"] = "act"
    """``act``: ``act(gate) * up``; ``clamped_swiglu``: GPT-OSS's ``(clamp(up) + 1) * g * sigmoid(alpha g)`` with
    ``g = clamp(gate)`` (the experts' ``alpha`` and ``limit``)."""
    dense_width_key: str | None = None
    """Config key of the dense MLP width of the layers that do not route (DeepSeek-V3's first layers, Llama 4's
    interleaved dense layers); None: every layer routes."""
    dense_first_key: str | None = None
    """Config key of how many leading layers are dense (``first_k_dense_replace``)."""
    moe_layers_key: str | None = None
    """Config key listing the layers that route (Llama 4's ``moe_layers``)."""

    @property
    def arch(self) -> ArchSpec:
        """The attention / norm layout (the dense relative's, with ``experts`` set)."""
        return ARCH_SPECS[self.model_type]

    def renormalises(self, config: Any) -> bool:
        """Whether the top-k routing weights are renormalised to sum to one after the top-k."""
        return True if self.norm_topk_key is None else bool(getattr(config, self.norm_topk_key))

    def routes(self, config: Any, index: int) -> bool:
        """Whether layer ``index`` is built with routed experts (rather than a dense MLP)."""
        if self.dense_first_key is not None and index < int(getattr(config, self.dense_first_key) or 0):
            return False
        if self.moe_layers_key is not None:
            return index in list(getattr(config, self.moe_layers_key) or [])
        return True


_COMMON: dict[str, Any] = dict(moe="mlp", router="mlp.gate", experts="mlp.experts")

MOE_SPECS: dict[str, MoESpec] = {
    "mixtral": MoESpec(
        "mixtral",
        count_key="num_local_experts",
        width_key="intermediate_size",
        norm_topk_key=None,
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
        **_COMMON,
    ),
    "qwen3_moe": MoESpec("qwen3_moe", count_key="num_local_experts", width_key="moe_intermediate_size", **_COMMON),
    "olmoe": MoESpec("olmoe", count_key="num_experts", width_key="intermediate_size", **_COMMON),
    **{  # sigmoid scores, group-limited choice, shared experts, dense first layers
        model_type: MoESpec(
            model_type,
            count_key="n_routed_experts",
            width_key="moe_intermediate_size",
            shared_expert="mlp.shared_experts",
            router_kind="sigmoid_grouped",
            router_vectors=("e_score_correction_bias",),
            scale_key="routed_scaling_factor",
            groups_key="n_group",
            top_groups_key="topk_group",
            dense_width_key="intermediate_size",
            dense_first_key="first_k_dense_replace",
            **_COMMON,
        )
        for model_type in ("deepseek_v3", "glm4_moe")
    },
    "gpt_oss": MoESpec(  # biased router and experts, interleaved gate/up stored as columns, clamped SwiGLU
        "gpt_oss",
        moe="mlp",
        router="mlp.router",
        experts="mlp.experts",
        count_key="num_local_experts",
        width_key="intermediate_size",
        norm_topk_key=None,
        hub_per_expert=False,
        router_kind="topk_softmax",
        router_vectors=("bias",),
        expert_layout="interleaved_columns",
        expert_glu="clamped_swiglu",
    ),
    "llama4_text": MoESpec(  # top-k logits scale each expert's input, a shared expert, interleaved dense layers
        "llama4_text",
        moe="feed_forward",
        router="feed_forward.router",
        experts="feed_forward.experts",
        count_key="num_local_experts",
        width_key="intermediate_size",
        norm_topk_key=None,
        shared_expert="feed_forward.shared_expert",
        hub_per_expert=False,
        router_kind="sigmoid_top",
        expert_layout="columns",
        dense_width_key="intermediate_size_mlp",
        moe_layers_key="moe_layers",
    ),
    # Hybrids (primitives/arch/layer_kinds.py) whose MLP is routed experts beside a sigmoid-gated shared expert, as
    # Qwen2-MoE's: Qwen 3.5's MoE variant always renormalises its top-k weights, Qwen3-Next as its config says.
    "qwen3_5_moe_text": MoESpec(
        "qwen3_5_moe_text",
        count_key="num_experts",
        width_key="moe_intermediate_size",
        norm_topk_key=None,
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
        **_COMMON,
    ),
    "qwen3_next": MoESpec(
        "qwen3_next",
        count_key="num_experts",
        width_key="moe_intermediate_size",
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
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
    if mlp and spec.arch.shared_mlp is None:
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
        return stored_width(self.spec.expert_layout, self.experts.down_proj)

    def rows(self) -> RowExperts:
        """The routed experts in the row form (:mod:`slimkit.primitives.arch.expert_layout`), detached."""
        experts = self.experts
        biases = [getattr(experts, name, None) for name in ("gate_up_proj_bias", "down_proj_bias")]
        return to_rows(
            self.spec.expert_layout,
            experts.gate_up_proj.detach(),
            experts.down_proj.detach(),
            *(None if b is None else b.detach() for b in biases),
        )

    def set_rows(self, rows: RowExperts) -> None:
        """Store ``rows`` (any expert count and width) as the family keeps its experts, each tensor on the device and
        in the dtype of the one it replaces; the run-time counts follow."""
        gate_up, down, gate_up_bias = from_rows(self.spec.expert_layout, rows)
        values = {
            "gate_up_proj": gate_up,
            "down_proj": down,
            "gate_up_proj_bias": gate_up_bias,
            "down_proj_bias": rows.down_bias,
        }
        for name, value in values.items():
            old = getattr(self.experts, name, None)
            if value is None or old is None:
                continue
            setattr(self.experts, name, nn.Parameter(value.to(old.device, old.dtype), requires_grad=old.requires_grad))

    def router_rule(self) -> Router:
        """The router's tensors and rule (:class:`~slimkit.primitives.experts.routers.Router`), detached."""
        from slimkit.primitives.experts.routers import Router  # experts imports arch

        spec, router, config = self.spec, self.router, self.config
        vectors = {name: getattr(router, name, None) for name in spec.router_vectors}
        logit_bias = vectors.get("bias")
        correction = vectors.get("e_score_correction_bias")
        return Router(
            router.weight.detach(),
            spec.router_kind,
            self.top_k,
            self.renormalises,
            bias=None if logit_bias is None else logit_bias.detach(),
            correction=None if correction is None else correction.detach(),
            scale=float(getattr(config, spec.scale_key)) if spec.scale_key else 1.0,
            groups=int(getattr(config, spec.groups_key) or 1) if spec.groups_key else 1,
            top_groups=int(getattr(config, spec.top_groups_key) or 1) if spec.top_groups_key else 1,
        )

    @property
    def router_groups(self) -> int:
        """The router's expert groups (1 unless its choice is group-limited)."""
        return self.router_rule().groups

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
        """Parameters of one routed expert (its gate/up and down slices, their biases) plus its router row and the
        router's per-expert vectors that are parameters."""
        hidden = int(self.router.weight.shape[1])
        biases = sum(
            int(getattr(self.experts, name).shape[-1])
            for name in ("gate_up_proj_bias", "down_proj_bias")
            if getattr(self.experts, name, None) is not None
        )
        vectors = sum(1 for name in self.spec.router_vectors if name in self.router._parameters)
        return 3 * hidden * self.width + hidden + biases + vectors

    def sync_counts(self) -> None:
        """Write the expert count into the attributes the router and experts read at run time."""
        count = self.num_experts
        if int(self.experts.gate_up_proj.shape[0]) != count or int(self.experts.down_proj.shape[0]) != count:
            raise ValueError(f"layer {self.index}: router rows and fused expert tensors disagree on the expert count")
        for module in (self.router, self.experts, self.module):
            if hasattr(module, "num_experts"):
                module.num_experts = count  # type: ignore[assignment]  # an int attribute torch types as Module
        if hasattr(self.router, "out_features"):  # Llama 4's router is an nn.Linear
            self.router.out_features = count  # type: ignore[assignment]

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
    return {
        spec.count_key: int(router.weight.shape[0]),
        spec.width_key: stored_width(spec.expert_layout, experts.down_proj),
    }


def mixed_layer_widths(layer: nn.Module, index: int, model_type: str, config: Any) -> dict[str, int] | None:
    """The MLP entries of one layer of a family whose layers mix dense and routed MLPs (None for any other family):
    a routed layer's expert count and width, a dense layer's width (zero for a removed MLP block).
    :func:`fill_mixed_widths` completes every layer with the other kind's entries."""
    spec = MOE_SPECS.get(model_type)
    if spec is None or spec.dense_width_key is None or config is None:
        return None
    if spec.routes(config, index):
        routed = layer_moe_widths(layer, model_type) or {}
        return {key: routed[key] for key in (spec.width_key, spec.count_key)}  # its width first (the report's)
    try:
        up = layer.get_submodule(spec.arch.up)
    except AttributeError:  # the dense MLP block was removed
        return {spec.dense_width_key: 0}
    return {spec.dense_width_key: int(up.out_features)}


def fill_mixed_widths(widths: list[dict[str, int]], model_type: str, config: Any) -> list[dict[str, int]]:
    """Every layer's widths with the MLP entries of the kind it is not: those of the first layer of that kind (the
    config's where there is none), so layers of one kind pruned alike compare equal and leave a config transformers
    builds (a no-op for other families)."""
    spec = MOE_SPECS.get(model_type)
    if spec is None or spec.dense_width_key is None or config is None:
        return widths
    kinds = {
        True: (spec.width_key, spec.count_key),
        False: (spec.dense_width_key,),
    }
    filled = []
    for index, own in enumerate(widths):
        entry = dict(own)
        other = not spec.routes(config, index)
        source = next((w for i, w in enumerate(widths) if spec.routes(config, i) == other), None)
        for key in kinds[other]:
            entry[key] = int(source[key]) if source is not None and key in source else int(getattr(config, key))
        filled.append(entry)
    return filled


def fused_expert_shapes(model_type: str | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a checkpoint as the model holds them: the hub's per-expert tensors (``experts.{e}.gate_proj``
    ...) as the fused ``experts.gate_up_proj`` ``(E, 2I, H)`` and ``experts.down_proj`` ``(E, H, I)`` that
    transformers builds from them on loading (its checkpoint conversion); other names unchanged."""
    spec = MOE_SPECS.get(model_type or "")
    if spec is None or not spec.hub_per_expert:
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
        router_name = prefix[id(block.router)]
        experts_name = prefix[id(block.experts)]
        shapes = {
            (block.router, "weight"): saved.get(router_name + ".weight"),
            (block.experts, "gate_up_proj"): saved.get(experts_name + ".gate_up_proj"),
            (block.experts, "down_proj"): saved.get(experts_name + ".down_proj"),
        }
        extra = {(block.router, name): saved.get(f"{router_name}.{name}") for name in block.spec.router_vectors}
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if getattr(block.experts, name, None) is not None:
                extra[(block.experts, name)] = saved.get(f"{experts_name}.{name}")
        for (module, name), shape in {**shapes, **extra}.items():
            current = getattr(module, name)
            if shape is not None and tuple(current.shape) != tuple(shape):
                fresh = torch.empty(shape, dtype=current.dtype, device=current.device)
                if name in module._parameters:
                    setattr(module, name, nn.Parameter(fresh))
                else:  # a buffer (the router's choice correction) stays a buffer
                    setattr(module, name, fresh)
        if all(shape is not None for shape in shapes.values()):
            block.sync_counts()


__all__ = [
    "MOE_SPECS",
    "MoEBlock",
    "MoESpec",
    "check_all_sparse",
    "fill_mixed_widths",
    "fused_expert_shapes",
    "layer_moe_widths",
    "materialise_experts",
    "mixed_layer_widths",
    "moe_blocks",
    "moe_spec",
    "role_refusal",
]
