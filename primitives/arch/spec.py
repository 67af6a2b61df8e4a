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

from slimkit.primitives.arch.latent_attention import LatentAttention
from slimkit.primitives.arch.layer_kinds import DeltaNetLayout, LayerKind, LayerKinds, Mamba2Layout

NormKind = Literal["rmsnorm", "layernorm"]
MLPKind = Literal["gated", "plain"]


@dataclass(frozen=True)
class FusedProjection:
    """One matrix a model holds fused (Phi-3's ``self_attn.qkv_proj``): its path relative to the layer, the parts it
    stacks by rows in order, and each part's width as a config key (times ``head_dim`` when ``per_head``)."""

    path: str
    parts: tuple[str, ...]
    part_widths: tuple[str, ...]
    per_head: bool = False


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: str
    embed: str
    final_norm: str | None
    head: str | None
    q: str
    k: str
    v: str | None
    """The value projection; None where keys and values come from one matrix (MLA's ``kv_b_proj``, named by ``k``)."""
    o: str
    attention: str
    up: str
    down: str
    gate: str | None
    attn_norm: str | None
    """The attention block's input norm (None: the block reads the residual stream as it is, OLMo 2)."""
    mlp_norm: str | None
    """The MLP's input norm (None as for ``attn_norm``)."""
    norm_kind: NormKind
    norm_placement: Literal["pre", "post"]
    """``pre``: the residual sum is never normalised inside a layer (``h + branch(h)``, whatever norms the branch
    holds); ``post``: a norm acts on the residual sum itself (BERT)."""
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
    attn_out_norm: str | None = None
    """A branch post-norm: normalises the attention block's *output* (over hidden) before the residual sum
    (Gemma 2/3 and OLMo 2's ``post_attention_layernorm``), relative to the layer."""
    mlp_out_norm: str | None = None
    """The MLP's branch post-norm (``post_feedforward_layernorm``), relative to the layer."""
    norm_offset: float = 0.0
    """RMSNorms scale by ``offset + w`` (Gemma: ``1 + w``, weights stored as offsets from 1); 0 for ``w``."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """What the q/k norms normalise: one head's ``head_dim`` (shared by every head: Qwen3, Gemma 3) or the whole
    projection, every head at once (OLMo 2: removing a head changes the statistic of the heads kept)."""
    embed_scale_key: str | None = None
    """The config width the embeddings are multiplied by the square root of (Gemma: ``hidden_size``), read from the
    config when the model is built, so it follows the saved width, not the trained one."""
    branch_scale_key: str | None = None
    """The config scalar each branch output is multiplied by before the residual sum (Granite's
    ``residual_multiplier``), or None."""
    scalar_keys: tuple[str, ...] = ()
    """Config scalars the forward multiplies into the stream, attention or logits (Granite's multipliers, Gemma 2's
    soft-capping): constants width changes keep, listed in the support table (a stage they matter to refuses through
    another field, e.g. ``branch_scale_key``)."""
    head_dim_from_hidden: bool = False
    """The attention's constructor derives its head width as ``hidden_size // num_attention_heads`` (and its
    ``scaling`` from that width) and refuses a head count that does not divide the hidden size (OPT, BERT: their
    configs hold no ``head_dim``), so a config holding pruned head counts does not rebuild the model
    (:mod:`slimkit.primitives.arch.derived_head_dim`)."""
    fused: tuple[FusedProjection, ...] = ()
    """Matrices held fused, seen as their parts (:mod:`slimkit.primitives.arch.fused`); the role paths above then
    name the parts (``self_attn.qkv_proj.q_proj``)."""
    head_config_keys: tuple[str, ...] = ()
    """Head counts the attention forward reads from its ``config`` rather than from its own attributes (Phi-3 splits
    ``qkv_proj`` at ``config.num_attention_heads * head_dim``): each attention module gets a config of its own whose
    values follow its layer's widths (:mod:`slimkit.primitives.arch.layer_config`)."""
    rotary_fraction_key: str | None = None
    """The config key of the fraction of each q/k head that RoPE rotates (``partial_rotary_factor``: Phi-4-mini
    rotates 3/4), read from ``rope_parameters`` or the config; None: RoPE rotates the whole head."""
    rope_pairs: Literal["half", "adjacent"] = "half"
    """Which dimensions of a q/k head RoPE rotates together: ``half`` pairs ``j`` with ``j + d/2`` (``rotate_half``,
    Llama), ``adjacent`` pairs ``2j`` with ``2j + 1`` (GLM-4's interleaved rotation)."""
    encoder: bool = False
    """An encoder (bidirectional attention, no KV cache): its heads may keep their own q/k and v/o widths
    (:mod:`slimkit.primitives.arch.head_widths`)."""
    gguf: str | None = None
    """llama.cpp's architecture slimkit writes a GGUF of this family as (``general.architecture``); None: no GGUF
    export (:mod:`slimkit.primitives.export.gguf_file`)."""
    hf_export: bool = True
    """Whether a compressed model of this family exports to a plain Hugging Face folder that stock
    ``from_pretrained`` reads (:mod:`slimkit.primitives.export.hf_folder`)."""
    shared_mlp: str | None = None
    """In a layer with routed experts, the dense MLP every token also uses (DeepSeek-V3's ``mlp.shared_experts``),
    relative to the layer: there the gate/up/down roles name its projections (``mlp.shared_experts.up_proj``), so
    MLP channel units, low-rank and refit stages reach it. None: a routed layer has no MLP projections."""
    extra_linears: tuple[str, ...] = ()
    """Projections of a layer beyond the q/k/v/o/gate/up/down roles (MLA's ``q_a_proj``, ``kv_a_proj_with_mqa``),
    relative to the layer: their inputs are measured with the roles' (activation scores read them)."""
    head_params: tuple[str, ...] = ()
    """Parameters of the attention with one entry per query head, sliced with the heads (GPT-OSS's attention
    sinks ``self_attn.sinks``), relative to the layer."""
    latent_attention: LatentAttention | None = None
    """Multi-head latent attention (:mod:`slimkit.primitives.arch.latent_attention`); then ``q`` is ``q_b_proj``,
    ``k`` the ``kv_b_proj`` that gives keys and values, ``v`` None."""
    mlp_returns_tuple: bool = False
    """The routed MLP block returns ``(output, router scores)`` (GPT-OSS, Llama 4), which a parameter-free stand-in
    for a removed block does not reproduce: whole-block removal is refused."""
    layer_kinds: LayerKinds | None = None
    """A hybrid's per-layer kinds (:mod:`slimkit.primitives.arch.layer_kinds`): which layers hold softmax attention
    (at the paths above), a gated DeltaNet or a Mamba-2 mixer, and the feed-forward block; None: every layer holds
    attention and the feed-forward block."""
    q_gate: bool = False
    """Gated attention (Qwen 3.5, Qwen3-Next): the query projection holds each head's query and its output gate side
    by side (``2 x head_dim`` rows per head, query first); ``sigmoid(gate)`` multiplies the head's output before
    ``o``, element by element."""

    @property
    def q_rows_per_head(self) -> int:
        """Rows of the query projection per query head (``2 x head_dim`` with an output gate)."""
        return 2 if self.q_gate else 1

    @property
    def mlp_kind(self) -> MLPKind:
        return "gated" if self.gate is not None else "plain"

    @property
    def branch_post_norms(self) -> bool:
        """Whether a norm acts on a branch's output before the residual sum (Gemma 2/3, OLMo 2)."""
        return self.attn_out_norm is not None or self.mlp_out_norm is not None

    def block_norms(self, kind: Literal["attention", "mlp"]) -> tuple[str, ...]:
        """The norms that belong to one sub-block (its input norm and its branch post-norm, where it has them)."""
        names = (self.attn_norm, self.attn_out_norm) if kind == "attention" else (self.mlp_norm, self.mlp_out_norm)
        return tuple(name for name in names if name is not None)

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """Every norm of a layer on the residual stream's width (q/k norms excluded), in forward order."""
        return (*self.block_norms("attention"), *self.block_norms("mlp"))

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
    gguf="llama",
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
    hf_export=False,
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
    head_dim_from_hidden=True,
)

_BERT = ArchSpec(
    model_type="bert",
    hf_export=False,
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
    head_dim_from_hidden=True,
    encoder=True,
)

# Mistral and Qwen2 keep Llama's module names. Qwen2 adds q/k/v biases, which need no data here:
# biases are read from the modules (groups slice them with their output rows, projections carry
# them). Mistral's sliding window and Qwen2's per-layer ``layer_types`` are config fields that no
# width change touches. Qwen3 adds per-head q/k RMSNorms (over head_dim) after the projections.
_MISTRAL = replace(_LLAMA, model_type="mistral")
_QWEN2 = replace(_LLAMA, model_type="qwen2", gguf="qwen2")
_QWEN3 = replace(_LLAMA, model_type="qwen3", gguf="qwen3", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")

# Mixture-of-experts decoders: attention and norms as their dense relatives, the MLP a router and fused experts
# (what is known of the router, the experts and the config keys lives in primitives/arch/moe.py). OLMoE's q/k norms
# act on the whole projection, not per head.
_MIXTRAL = replace(_MISTRAL, model_type="mixtral", experts="mlp.experts")
_MOE_WIDTH = "moe_intermediate_size"
_QWEN2_MOE = replace(
    _QWEN2, model_type="qwen2_moe", gguf="qwen2moe", experts="mlp.experts", intermediate_size_key=_MOE_WIDTH
)
_QWEN3_MOE = replace(
    _QWEN3, model_type="qwen3_moe", gguf="qwen3moe", experts="mlp.experts", intermediate_size_key=_MOE_WIDTH
)
_OLMOE = replace(_QWEN3, model_type="olmoe", gguf="olmoe", experts="mlp.experts", qk_norm_scope="projection")

# Gemma: Llama's names, RMSNorms scaled by (1 + w), embeddings multiplied by sqrt(hidden_size). Gemma 2 and 3 add
# branch post-norms (``post_attention_layernorm`` normalises the attention output, so the MLP's input norm is
# ``pre_feedforward_layernorm``), soft-capping (Gemma 2) and sliding-window ``layer_types``; Gemma 3 adds per-head
# q/k norms. Soft-capping, sliding windows and query_pre_attn_scalar are config constants no width change touches.
_GEMMA = replace(_LLAMA, model_type="gemma", gguf="gemma", norm_offset=1.0, embed_scale_key="hidden_size")
_GEMMA2 = replace(
    _GEMMA,
    model_type="gemma2",
    gguf="gemma2",
    mlp_norm="pre_feedforward_layernorm",
    attn_out_norm="post_attention_layernorm",
    mlp_out_norm="post_feedforward_layernorm",
    activation_attr="hidden_activation",
    scalar_keys=("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
)
_GEMMA3 = replace(
    _GEMMA2, model_type="gemma3_text", gguf="gemma3", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"
)
# Granite: Llama's modules; the embedding, attention and residual multipliers and the logits scaling are scalars.
_GRANITE = replace(
    _LLAMA,
    model_type="granite",
    gguf="granite",
    branch_scale_key="residual_multiplier",
    scalar_keys=("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"),
)
# OLMo 2: no input norms, branch post-norms only (``h + norm(attn(h))``), and q/k RMSNorms over the whole q and k
# projections (``num_heads * head_dim`` wide).
_OLMO2 = replace(
    _LLAMA,
    model_type="olmo2",
    gguf="olmo2",
    attn_norm=None,
    mlp_norm=None,
    attn_out_norm="post_attention_layernorm",
    mlp_out_norm="post_feedforward_layernorm",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_scope="projection",
)
# Phi-3 / Phi-4-mini: Llama's layout with q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (seen as
# their parts), an attention that splits qkv at ``config.num_attention_heads`` (one config per attention module), and
# RoPE over a fraction of each head (``partial_rotary_factor``). longrope scaling and sliding windows are constants.
_PHI3 = replace(
    _LLAMA,
    model_type="phi3",
    gguf="phi3",
    q="self_attn.qkv_proj.q_proj",
    k="self_attn.qkv_proj.k_proj",
    v="self_attn.qkv_proj.v_proj",
    gate="mlp.gate_up_proj.gate_proj",
    up="mlp.gate_up_proj.up_proj",
    fused=(
        FusedProjection(
            "self_attn.qkv_proj",
            ("q_proj", "k_proj", "v_proj"),
            ("num_attention_heads", "num_key_value_heads", "num_key_value_heads"),
            per_head=True,
        ),
        FusedProjection("mlp.gate_up_proj", ("gate_proj", "up_proj"), ("intermediate_size", "intermediate_size")),
    ),
    head_config_keys=("num_attention_heads", "num_key_value_heads"),
    rotary_fraction_key="partial_rotary_factor",
)
# OLMo 3: OLMo 2's modules and norms; sliding-window ``layer_types`` (config constants no width change touches).
_OLMO3 = replace(_OLMO2, model_type="olmo3")
# GLM-4 (dense): Llama's attention with q/k/v biases, gate and up fused into ``gate_up_proj`` (gate rows first), four
# norms a layer (the input norms and a branch post-norm after each block), RoPE over the first half of each head in
# adjacent pairs.
_GLM4 = replace(
    _LLAMA,
    model_type="glm4",
    gguf="glm4",
    gate="mlp.gate_up_proj.gate_proj",
    up="mlp.gate_up_proj.up_proj",
    attn_out_norm="post_self_attn_layernorm",
    mlp_out_norm="post_mlp_layernorm",
    fused=(FusedProjection("mlp.gate_up_proj", ("gate_proj", "up_proj"), ("intermediate_size", "intermediate_size")),),
    rotary_fraction_key="partial_rotary_factor",
    rope_pairs="adjacent",
)
# Mixture-of-experts decoders released since (what is known of their routers lives in primitives/arch/moe.py).
# DeepSeek-V3 / Kimi K2: multi-head latent attention, dense first layers, routed experts beside shared experts.
_DEEPSEEK_V3 = replace(
    _LLAMA,
    model_type="deepseek_v3",
    gguf=None,  # llama.cpp has it; slimkit does not write its layout (primitives/export/gguf_arch.py)
    q="self_attn.q_b_proj",
    k="self_attn.kv_b_proj",
    v=None,
    head_dim_attr="qk_head_dim",
    experts="mlp.experts",
    shared_mlp="mlp.shared_experts",
    intermediate_size_key="moe_intermediate_size",
    extra_linears=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    latent_attention=LatentAttention(),
)
# GLM-4.5: Llama's attention with optional per-head q/k norms and RoPE over part of each head (rotate_half), DeepSeek's
# router, shared experts and dense first layers.
_GLM4_MOE = replace(
    _LLAMA,
    model_type="glm4_moe",
    gguf="glm4moe",
    experts="mlp.experts",
    shared_mlp="mlp.shared_experts",
    intermediate_size_key="moe_intermediate_size",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    rotary_fraction_key="partial_rotary_factor",
)
# GPT-OSS: Llama's attention with biases and one learned sink logit per query head; every layer routes; sliding and
# full layers alternate (config layer_types, kept as they are).
_GPT_OSS = replace(
    _LLAMA,
    model_type="gpt_oss",
    gguf=None,  # llama.cpp has it; slimkit does not write its layout (primitives/export/gguf_arch.py)
    experts="mlp.experts",
    head_params=("self_attn.sinks",),
    mlp_returns_tuple=True,
)
# Llama 4 (text): the MLP module is ``feed_forward``, dense in some layers and routed (with a shared expert) in the
# others (config moe_layers); RoPE in adjacent pairs, none in every fourth layer (no_rope_layers); a weightless L2
# norm per q/k head in the RoPE layers.
_LLAMA4 = replace(
    _LLAMA,
    model_type="llama4_text",
    gguf=None,  # llama.cpp has it; slimkit does not write its layout (primitives/export/gguf_arch.py)
    layers="model.layers",  # Llama4ForCausalLM's base_model_prefix names no attribute: paths from the model itself
    embed="model.embed_tokens",
    final_norm="model.norm",
    gate="feed_forward.gate_proj",
    up="feed_forward.up_proj",
    down="feed_forward.down_proj",
    mlp="feed_forward",
    experts="feed_forward.experts",
    shared_mlp="feed_forward.shared_expert",
    q_norm="self_attn.qk_norm",
    k_norm="self_attn.qk_norm",
    rope_pairs="adjacent",
    mlp_returns_tuple=True,
)
# Decoders whose modules and forward are Llama's (checked against their transformers modeling files): the same spec
# covers them with no new code.
SAME_AS_LLAMA = ("helium", "ministral", "seed_oss", "smollm3")


# Hybrids: decoder layers of several kinds (primitives/arch/layer_kinds.py). Qwen 3.5 (text): Qwen3's layout with
# (1 + w) RMSNorms, gated attention (query and output gate per head in q_proj), RoPE over a quarter of each head,
# and gated DeltaNet layers (``linear_attn``) where ``layer_types`` says ``linear_attention``; the MoE variant and
# Qwen3-Next route their MLP to experts beside a gated shared expert (primitives/arch/moe.py), Qwen3-Next with q/k/v/z
# and b/a fused per key head. Nemotron-H: one block per layer (Mamba-2, attention or MLP, each under one ``norm``).
# Granite 4.0-H: Granite's scalars, Mamba-2 or attention then a fused gated ``shared_mlp`` in every layer.
_QWEN_HYBRID_KINDS = LayerKinds(
    "layer_types",
    (("full_attention", LayerKind("attention")), ("linear_attention", LayerKind("gated_deltanet"))),
    deltanet=DeltaNetLayout(),
)
_QWEN3_5 = replace(
    _QWEN3,
    model_type="qwen3_5_text",
    gguf=None,  # llama.cpp has qwen35; slimkit does not write its layout (primitives/export/gguf_hybrid.py)
    norm_offset=1.0,
    q_gate=True,
    rotary_fraction_key="partial_rotary_factor",
    layer_kinds=_QWEN_HYBRID_KINDS,
)
_QWEN3_5_MOE = replace(_QWEN3_5, model_type="qwen3_5_moe_text", experts="mlp.experts", intermediate_size_key=_MOE_WIDTH)
_QWEN3_NEXT = replace(
    _QWEN3_5_MOE,
    model_type="qwen3_next",
    layer_kinds=replace(_QWEN_HYBRID_KINDS, deltanet=DeltaNetLayout(fused_qkvz=True)),
)
_NEMOTRON_H = ArchSpec(
    model_type="nemotron_h",
    gguf="nemotron_h",
    layers="layers",
    embed="embeddings",
    final_norm="norm_f",
    head="lm_head",
    attention="mixer",
    q="mixer.q_proj",
    k="mixer.k_proj",
    v="mixer.v_proj",
    o="mixer.o_proj",
    up="mixer.up_proj",
    gate=None,
    down="mixer.down_proj",
    mlp="mixer",
    attn_norm="norm",
    mlp_norm="norm",
    norm_kind="rmsnorm",
    norm_placement="pre",
    rope=False,
    activation_attr="mlp_hidden_act",
    head_dim_attr="head_dim",
    intermediate_size_key="intermediate_size",
    layer_kinds=LayerKinds(
        "layer_types",
        (
            ("linear_attention", LayerKind("mamba2", ffn=False)),
            ("full_attention", LayerKind("attention", ffn=False)),
            ("mlp", LayerKind(None)),
        ),
        mamba=Mamba2Layout("mixer", "mamba_num_heads", "n_groups", "mamba_head_dim"),
    ),
)
_GRANITE_HYBRID = replace(
    _GRANITE,
    model_type="granitemoehybrid",
    gguf="granitehybrid",
    mlp="shared_mlp",
    gate="shared_mlp.input_linear.gate_proj",
    up="shared_mlp.input_linear.up_proj",
    down="shared_mlp.output_linear",
    intermediate_size_key="shared_intermediate_size",
    fused=(
        FusedProjection(
            "shared_mlp.input_linear",
            ("gate_proj", "up_proj"),
            ("shared_intermediate_size", "shared_intermediate_size"),
        ),
    ),
    layer_kinds=LayerKinds(
        "layer_types",
        (("full_attention", LayerKind("attention")), ("linear_attention", LayerKind("mamba2"))),
        mamba=Mamba2Layout("mamba", "mamba_n_heads", "mamba_n_groups", "mamba_d_head"),
        uncovered_experts="num_local_experts",
    ),
)
HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h", "granitemoehybrid")
"""The decoders whose layers are of several kinds."""


def gguf_model_types() -> tuple[str, ...]:
    """The model types slimkit writes GGUF files of (their ``gguf`` architecture set)."""
    return tuple(model_type for model_type, spec in ARCH_SPECS.items() if spec.gguf is not None)


def hf_model_types() -> tuple[str, ...]:
    """The model types a compressed model exports to a plain Hugging Face folder of."""
    return tuple(model_type for model_type, spec in ARCH_SPECS.items() if spec.hf_export)


def removable_blocks(spec: ArchSpec) -> str | None:
    """None when whole attention and MLP blocks of ``spec``'s layers can be removed, else why not (one phrase).

    A removed block must add nothing to the residual stream: true of a pre-norm layer (``h + block(norm(h))``),
    not of a post-norm one, whose norm acts on the sum; the MLP must be one module to stand in for."""
    if spec.norm_placement != "pre":
        return f"{spec.model_type} layers normalise after the residual sum (post-norm), so no block can be skipped"
    # A branch post-norm of a removed block normalises zeros: RMSNorm(0) = 0 * rsqrt(eps) * w = 0, so the branch
    # still adds nothing (the norm goes with the block).
    if spec.mlp is None:
        return f"{spec.model_type} layers hold their MLP projections directly (no MLP module to stand in for)"
    if spec.mlp_returns_tuple:
        return (
            f"{spec.model_type}'s routed MLP returns its router scores beside its output, which a stand-in for a "
            "removed block does not give"
        )
    if spec.layer_kinds is not None:
        return (
            f"its layers are of several kinds ({spec.layer_kinds.config_key}), and whole-block removal knows only "
            "decoders whose layers all hold attention and an MLP"
        )
    return None


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    "qwen2": _QWEN2,
    "qwen3": _QWEN3,
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,
    "granite": _GRANITE,
    "olmo2": _OLMO2,
    "olmo3": _OLMO3,
    "glm4": _GLM4,
    "phi3": _PHI3,
    **{model_type: replace(_LLAMA, model_type=model_type, gguf=None) for model_type in SAME_AS_LLAMA},
    "opt": _OPT,
    "bert": _BERT,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "olmoe": _OLMOE,
    "deepseek_v3": _DEEPSEEK_V3,
    "glm4_moe": _GLM4_MOE,
    "gpt_oss": _GPT_OSS,
    "llama4_text": _LLAMA4,
}
ARCH_SPECS.update(
    {
        "qwen3_5_text": _QWEN3_5,
        "qwen3_5_moe_text": _QWEN3_5_MOE,
        "qwen3_next": _QWEN3_NEXT,
        "nemotron_h": _NEMOTRON_H,
        "granitemoehybrid": _GRANITE_HYBRID,
    }
)
