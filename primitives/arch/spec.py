"""Architecture knowledge as data: where each part of a supported model lives.

One :class:`ArchSpec` per Hugging Face ``model_type``. Paths are attribute paths relative to the
model's ``base_model`` (layers, embeddings, final norm) or to one decoder/encoder layer (attention,
MLP, norms); ``head`` is relative to the full model. Nothing here touches a forward pass: slimkit
never copies a model's forward code, it only edits modules and the few attributes each attention
implementation reads (``head_attrs``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

NormKind = Literal["rmsnorm", "layernorm"]
MLPKind = Literal["gated", "plain"]


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: str
    embed: str
    final_norm: str | None
    head: str | None
    q: str
    k: str
    v: str
    o: str
    attention: str
    up: str
    down: str
    gate: str | None
    attn_norm: str
    mlp_norm: str
    norm_kind: NormKind
    norm_placement: Literal["pre", "post"]
    rope: bool
    activation_attr: str
    head_dim_attr: str
    """Attribute on the attention module holding the per-head width."""
    intermediate_size_key: str
    """Config key of the MLP width (``intermediate_size`` or ``ffn_dim``)."""
    extra_embeddings: tuple[str, ...] = ()
    """Other embeddings that write the residual stream (positions, token types), relative to base."""
    extra_norms: tuple[str, ...] = ()
    """Other norms on the residual stream outside the layers (e.g. BERT's embedding LayerNorm)."""
    q_norm: str | None = None
    """Per-head norm on the queries after the projection (Qwen3: RMSNorm over ``head_dim``, shared by
    every head), relative to the layer; None when the model has none."""
    k_norm: str | None = None
    """Per-head norm on the keys after the projection (Qwen3), relative to the layer."""
    mlp: str | None = None
    """The MLP as one module of the layer (``mlp`` in the Llama family), relative to the layer; None when its
    projections sit in the layer itself (OPT, BERT). Whole sub-blocks are removable only where it is set and the
    norms are pre-norms (:func:`removable_blocks`)."""
    experts: str | None = None
    """The fused routed experts of a mixture-of-experts MLP (``mlp.experts``), relative to the layer; None for a dense
    MLP. Such a layer's MLP has no gate/up/down projections as modules (:mod:`slimkit.primitives.arch.moe`)."""
    encoder: bool = False
    """An encoder (bidirectional attention, no KV cache): its heads may keep their own q/k and v/o widths
    (:mod:`slimkit.primitives.arch.head_widths`)."""

    @property
    def mlp_kind(self) -> MLPKind:
        return "gated" if self.gate is not None else "plain"

    @property
    def qk_norms(self) -> bool:
        """Whether queries/keys pass a per-head norm over ``head_dim`` before the dot product.

        Removing whole heads leaves such a norm unchanged (it is shared by all heads); removing or
        rotating dimensions inside a head changes its statistic, so ``qk_dim`` groups and Q/K
        projections inside heads are refused for these models.
        """
        return self.q_norm is not None or self.k_norm is not None


_LLAMA = ArchSpec(
    model_type="llama",
    layers="layers",
    embed="embed_tokens",
    final_norm="norm",
    head="lm_head",
    attention="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.o_proj",
    up="mlp.up_proj",
    gate="mlp.gate_proj",
    down="mlp.down_proj",
    mlp="mlp",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
    norm_kind="rmsnorm",
    norm_placement="pre",
    rope=True,
    activation_attr="hidden_act",
    head_dim_attr="head_dim",
    intermediate_size_key="intermediate_size",
)

_OPT = ArchSpec(
    model_type="opt",
    layers="decoder.layers",
    embed="decoder.embed_tokens",
    final_norm="decoder.final_layer_norm",
    head="lm_head",
    attention="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o="self_attn.out_proj",
    up="fc1",
    gate=None,
    down="fc2",
    attn_norm="self_attn_layer_norm",
    mlp_norm="final_layer_norm",
    norm_kind="layernorm",
    norm_placement="pre",
    rope=False,
    activation_attr="activation_function",
    head_dim_attr="head_dim",
    intermediate_size_key="ffn_dim",
    extra_embeddings=("decoder.embed_positions",),
)

_BERT = ArchSpec(
    model_type="bert",
    layers="encoder.layer",
    embed="embeddings.word_embeddings",
    final_norm=None,
    head=None,
    attention="attention.self",
    q="attention.self.query",
    k="attention.self.key",
    v="attention.self.value",
    o="attention.output.dense",
    up="intermediate.dense",
    gate=None,
    down="output.dense",
    attn_norm="attention.output.LayerNorm",
    mlp_norm="output.LayerNorm",
    norm_kind="layernorm",
    norm_placement="post",
    rope=False,
    activation_attr="hidden_act",
    head_dim_attr="attention_head_size",
    intermediate_size_key="intermediate_size",
    extra_embeddings=("embeddings.position_embeddings", "embeddings.token_type_embeddings"),
    extra_norms=("embeddings.LayerNorm",),
    encoder=True,
)

# Mistral and Qwen2 keep Llama's module names. Qwen2 adds q/k/v biases, which need no data here:
# biases are read from the modules (groups slice them with their output rows, projections carry
# them). Mistral's sliding window and Qwen2's per-layer ``layer_types`` are config fields that no
# width change touches. Qwen3 adds per-head q/k RMSNorms (over head_dim) after the projections.
_MISTRAL = replace(_LLAMA, model_type="mistral")
_QWEN2 = replace(_LLAMA, model_type="qwen2")
_QWEN3 = replace(_LLAMA, model_type="qwen3", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

# Mixture-of-experts decoders: attention and norms as their dense relatives, the MLP a router and fused experts
# (what is known of the router, the experts and the config keys lives in primitives/arch/moe.py). OLMoE's q/k norms
# act on the whole projection, not per head.
_MIXTRAL = replace(_MISTRAL, model_type="mixtral", experts="mlp.experts")
_MOE_WIDTH = "moe_intermediate_size"
_QWEN2_MOE = replace(_QWEN2, model_type="qwen2_moe", experts="mlp.experts", intermediate_size_key=_MOE_WIDTH)
_QWEN3_MOE = replace(_QWEN3, model_type="qwen3_moe", experts="mlp.experts", intermediate_size_key=_MOE_WIDTH)
_OLMOE = replace(_QWEN3, model_type="olmoe", experts="mlp.experts")


def removable_blocks(spec: ArchSpec) -> str | None:
    """None when whole attention and MLP blocks of ``spec``'s layers can be removed, else why not (one phrase).

    A removed block must add nothing to the residual stream: true of a pre-norm layer (``h + block(norm(h))``),
    not of a post-norm one, whose norm acts on the sum; the MLP must be one module to stand in for."""
    if spec.norm_placement != "pre":
        return f"{spec.model_type} layers normalise after the residual sum (post-norm), so no block can be skipped"
    if spec.mlp is None:
        return f"{spec.model_type} layers hold their MLP projections directly (no MLP module to stand in for)"
    return None


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "opt": _OPT,
    "bert": _BERT,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "olmoe": _OLMOE,
}
