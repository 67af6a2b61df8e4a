"""Architecture knowledge as data: where each part of a supported model lives.

One :class:`ArchSpec` per Hugging Face ``model_type``. Paths are attribute paths relative to the
model's ``base_model`` (layers, embeddings, final norm) or to one decoder/encoder layer (attention,
MLP, norms); ``head`` is relative to the full model. Nothing here touches a forward pass: slimkit
never copies a model's forward code, it only edits modules and the few attributes each attention
implementation reads (``head_attrs``).
"""

from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def mlp_kind(self) -> MLPKind:
        return "gated" if self.gate is not None else "plain"


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
)

# Qwen2 and Mistral keep Llama's module names (Qwen2 adds q/k/v biases, which the view handles
# generically because it reads biases from the modules).
ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "opt": _OPT,
    "bert": _BERT,
}
