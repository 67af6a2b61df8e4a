"""llama.cpp architectures of the decoder families added as data: their tensor names, the metadata each reads and the
checks that refuse, in one line, what its graph would compute otherwise (OLMo 3 as ``olmo2``, GLM-4 as ``glm4``).

:mod:`.gguf_file` writes the file; this module says, per family, what goes in it. Method note:
docs/methods/export-gguf.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf

from slimkit.primitives.errors import SlimkitError


@dataclass(frozen=True)
class GgufFamily:
    """How one Hugging Face ``model_type`` is written for its llama.cpp architecture
    (:attr:`~slimkit.primitives.arch.spec.ArchSpec.gguf`)."""

    layer_tensors: dict[str, str]
    """Hugging Face names inside a layer (``self_attn.q_proj.weight``) to llama.cpp's (``attn_q.weight``)."""
    check: Callable[[Any], list[str]]
    """Refuses (one :class:`SlimkitError` line) a config llama.cpp would compute otherwise; returns warnings."""
    metadata: Callable[[gguf.GGUFWriter, Any], None] = lambda writer, config: None
    """Keys beyond the common ones (``gguf_file._metadata`` writes widths, RoPE base and norm epsilon)."""
    padded: bool = True
    """llama.cpp builds every layer from one head count and feed-forward length: per-layer widths are padded."""
    fused_mlp: bool = False
    """Gate and up are written as one ``ffn_up`` (gate rows first)."""
    biases: tuple[str, ...] = field(default_factory=tuple)
    """Config flags of biases llama.cpp reads for this architecture (``attention_bias``)."""


OLMO2_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}

OLMO3_FULL_EVERY = 4
"""llama.cpp's olmo2 with a sliding window makes every 4th layer full attention (it reads no layer types)."""


def _rope(config: Any, kind: str) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params.get(kind) or {}) if isinstance(params, dict) else {}


def check_olmo3(config: Any) -> list[str]:
    """The layer pattern llama.cpp fixes, and one RoPE (no scaling) on both layer kinds."""
    layers = int(config.num_hidden_layers)
    expected = ["full_attention" if (i + 1) % OLMO3_FULL_EVERY == 0 else "sliding_attention" for i in range(layers)]
    if list(config.layer_types) != expected:
        raise SlimkitError(
            f"layer_types: llama.cpp's olmo2 (which runs OLMo 3) makes every {OLMO3_FULL_EVERY}th layer full "
            "attention and the others sliding; this model's pattern differs, so its GGUF would compute other outputs"
        )
    full, local = _rope(config, "full_attention"), _rope(config, "sliding_attention")
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        if params.get("rope_type", "default") != "default":
            raise SlimkitError(
                f"rope scaling '{params.get('rope_type')}' on {kind} layers is not written by slimkit's GGUF export"
            )
    if float(full.get("rope_theta", 0.0)) != float(local.get("rope_theta", 0.0)):
        raise SlimkitError("RoPE bases that differ between sliding and full layers: llama.cpp's olmo2 reads one")
    return []


def olmo3_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_sliding_window(int(config.sliding_window))


def olmo3_rope_theta(config: Any) -> float:
    return float(_rope(config, "full_attention")["rope_theta"])


GLM4_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_self_attn_layernorm.weight": "post_attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_mlp_layernorm.weight": "post_ffw_norm.weight",
}
"""GLM-4's names: ``post_self_attn_layernorm`` is the attention branch's post-norm, ``post_attention_layernorm`` the
MLP's input norm; gate and up stay fused (llama.cpp splits ``ffn_up`` itself, gate first). RoPE rotates adjacent
pairs in both (llama.cpp's ``NORM`` type for glm4): no row permutation."""


def check_glm4(config: Any) -> list[str]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default":
        raise SlimkitError(f"rope scaling '{params.get('rope_type')}' is not written by slimkit's GGUF export")
    if "mrope_section" in params:
        raise SlimkitError("multimodal RoPE sections (mrope_section) are not written by slimkit's GGUF export")
    return []


FAMILIES: dict[str, GgufFamily] = {
    "olmo3": GgufFamily(OLMO2_LAYER_TENSORS, check_olmo3, olmo3_metadata),
    "glm4": GgufFamily(GLM4_LAYER_TENSORS, check_glm4, fused_mlp=True, biases=("attention_bias",)),
}
"""The families this module writes, by Hugging Face ``model_type``."""

ROPE_THETA: dict[str, Callable[[Any], float]] = {"olmo3": olmo3_rope_theta}

NOT_WRITTEN: dict[str, str] = {
    "deepseek_v3": "deepseek2 (latent attention with kv_b_proj split into k_b / v_b, grouped sigmoid routing)",
    "glm4_moe": "glm4moe (grouped sigmoid routing with exp_probs_b, shared experts, leading dense layers)",
    "gpt_oss": "gpt-oss (attention sinks, expert biases, llama.cpp's fixed SwiGLU limit)",
    "llama4_text": "llama4 (interleaved dense and MoE layers, no-RoPE layers, chunked attention)",
}
"""Families llama.cpp runs whose GGUF layout slimkit does not write yet, and llama.cpp's architecture for each."""


def not_written(model_type: str) -> str | None:
    """One line for a family llama.cpp has an architecture for that slimkit's GGUF writer does not write, or None."""
    if model_type not in NOT_WRITTEN:
        return None
    return (
        f"GGUF export of {model_type}: llama.cpp runs it as {NOT_WRITTEN[model_type]}, a layout slimkit's GGUF "
        "writer does not write; export --format hf (stock transformers reads it) or serve it with slimkit.load"
    )


"""Where a family's RoPE base is, when not ``rope_parameters["rope_theta"]`` (OLMo 3: per layer kind)."""


__all__ = [
    "FAMILIES",
    "NOT_WRITTEN",
    "ROPE_THETA",
    "GgufFamily",
    "check_glm4",
    "check_olmo3",
    "not_written",
]
