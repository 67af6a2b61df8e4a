"""llama.cpp architectures of the decoder families added as data: their tensor names, the metadata each reads and the
checks that refuse, in one line, what its graph would compute otherwise (OLMo 3 as ``olmo2``, GLM-4 as ``glm4``,
GLM-4.5 as ``glm4moe``).

:mod:`.gguf_file` writes the file; this module says, per family, what goes in it. Method note:
docs/methods/export-gguf.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.dense import DenseModel


@dataclass(frozen=True)
class GgufFamily:
    """How one Hugging Face ``model_type`` is written for its llama.cpp architecture
    (:attr:`~slimkit.primitives.arch.spec.ArchSpec.gguf`)."""

    layer_tensors: dict[str, str]
    """Hugging Face names inside a layer (``self_attn.q_proj.weight``) to llama.cpp's (``attn_q.weight``)."""
    check: Callable[[Any], list[str]]
    """Refuses (one :class:`SlimkitError` line) a config llama.cpp would compute otherwise; returns warnings."""
    metadata: Callable[[gguf.GGUFWriter, Any, dict[str, torch.Tensor]], None] = lambda writer, config, tensors: None
    """Keys beyond the common ones (``gguf_file._metadata`` writes widths, RoPE base and norm epsilon), from the config
    and the tensors written."""
    padded: bool = True
    """llama.cpp builds every layer from one head count and feed-forward length: per-layer widths are padded."""
    fused_mlp: bool = False
    """Gate and up are written as one ``ffn_up`` (gate rows first)."""
    biases: tuple[str, ...] = field(default_factory=tuple)
    """Config flags of biases llama.cpp reads for this architecture (``attention_bias``)."""
    fit_tensors: Callable[[DenseModel, Any], str | None] = lambda dense, config: None
    """Pads (in place, exactly) widths llama.cpp reads otherwise and returns the note, or refuses in one line what it
    would not load; before anything is written."""


ATTENTION_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
}
"""The attention rows llama.cpp names alike in every architecture slimkit writes (its input norm, q/k/v with their
biases, the output projection); each family's table adds its own."""
QK_NORM_TENSORS = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
"""Per-head query and key norms (Qwen3, GLM-4.5, OLMo 2)."""


OLMO2_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    **QK_NORM_TENSORS,
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


def olmo3_metadata(writer: gguf.GGUFWriter, config: Any, tensors: dict[str, torch.Tensor]) -> None:
    writer.add_sliding_window(int(config.sliding_window))


def olmo3_rope_theta(config: Any) -> float:
    return float(_rope(config, "full_attention")["rope_theta"])


GLM4_LAYER_TENSORS = {
    **ATTENTION_TENSORS,
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


GLM4_MOE_LAYER_TENSORS = {
    **ATTENTION_TENSORS,
    **QK_NORM_TENSORS,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
"""GLM-4.5's names (llama.cpp's converter): ``post_attention_layernorm`` is the MLP's input norm, read as
``post_attention_norm``; the router's ``e_score_correction_bias`` (added to the scores for the choice only) as
``exp_probs_b``; the stacked routed experts and the shared experts as in Qwen2-MoE; the leading dense layers' MLP as
``ffn_*``. RoPE over the first part of each head in halves (llama.cpp's ``NEOX`` for glm4moe): no row permutation."""


def check_glm4_moe(config: Any) -> list[str]:
    """The RoPE llama.cpp's glm4moe reads (no scaling, no multimodal sections); the warning that the checkpoint's
    multi-token-prediction layers are not written (transformers builds none, so the model holds none)."""
    check_glm4(config)
    nextn = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if nextn:
        return [
            f"num_nextn_predict_layers {nextn}: the checkpoint's multi-token-prediction layer is not written "
            "(transformers does not build it); the file has no MTP draft layer for llama.cpp's speculative decoding"
        ]
    return []


def _glm4_moe_widths(tensors: dict[str, torch.Tensor]) -> tuple[int, list[int]]:
    """The routed expert width (one line where layers differ) and each layer's shared expert width."""
    experts = {tuple(t.shape) for n, t in tensors.items() if n.endswith("mlp.experts.down_proj")}
    if len(experts) > 1:
        raise SlimkitError(
            f"routed experts of shapes {sorted(experts)} differ between layers: llama.cpp's glm4moe reads one expert "
            "count and width; prune with allocation: uniform, or serve it with slimkit.load"
        )
    shared = [int(t.shape[0]) for n, t in tensors.items() if n.endswith("mlp.shared_experts.gate_proj.weight")]
    return (experts.pop()[2] if experts else 0), shared


def glm4_moe_metadata(writer: gguf.GGUFWriter, config: Any, tensors: dict[str, torch.Tensor]) -> None:
    """The keys llama.cpp's converter writes beyond the common MoE ones: the shared expert count (shared width over
    the expert width, which :func:`fit_glm4_moe_shared` made a multiple), leading dense layers, the routed scaling
    and renormalisation, sigmoid gating, no MTP layer (the model holds none); group-limited routing as llama.cpp's
    expert groups where it limits the choice (``topk_group < n_group``; GLM-4.5 has one group)."""
    width, shared = _glm4_moe_widths(tensors)
    writer.add_expert_shared_count(shared[0] // width if shared and width else 0)
    writer.add_leading_dense_block_count(int(config.first_k_dense_replace))
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_nextn_predict_layers(0)
    groups, top_groups = int(config.n_group or 1), int(config.topk_group or 1)
    if top_groups < groups:
        writer.add_expert_group_count(groups)
        writer.add_expert_group_used_count(top_groups)


def fit_glm4_moe_shared(dense: DenseModel, config: Any) -> str | None:
    """Pad every layer's shared experts (in place) with zero channels to one width, a multiple of the routed expert
    width: llama.cpp's glm4moe builds them as ``expert_shared_count`` experts of that width. A zero channel adds
    exactly nothing (``silu(0) * 0``). Returns the note, or None when nothing was padded."""
    width, shared = _glm4_moe_widths(dense.tensors)
    if not shared or not width:
        return None
    target = -(-max(shared) // width) * width
    if set(shared) == {target}:
        return None
    added = 0
    for name in [n for n in dense.tensors if n.endswith("mlp.shared_experts.gate_proj.weight")]:
        stem = name.removesuffix("gate_proj.weight")
        gate, up, down = (dense.tensors[f"{stem}{role}_proj.weight"] for role in ("gate", "up", "down"))
        extra = target - gate.shape[0]
        if extra:
            dense.tensors[f"{stem}gate_proj.weight"] = torch.cat([gate, gate.new_zeros(extra, gate.shape[1])])
            dense.tensors[f"{stem}up_proj.weight"] = torch.cat([up, up.new_zeros(extra, up.shape[1])])
            dense.tensors[f"{stem}down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], 1)
            added += extra * (gate.shape[1] + up.shape[1] + down.shape[0])
    dense.added_params += added
    return (
        f"shared experts of widths {sorted(set(shared))} padded with zero channels to {target} ({target // width} x "
        f"the expert width {width}, as llama.cpp's glm4moe reads them; {added} parameters, exact, no speed gain)"
    )


FAMILIES: dict[str, GgufFamily] = {
    "olmo3": GgufFamily(OLMO2_LAYER_TENSORS, check_olmo3, olmo3_metadata),
    "glm4": GgufFamily(GLM4_LAYER_TENSORS, check_glm4, fused_mlp=True, biases=("attention_bias",)),
    "glm4_moe": GgufFamily(
        GLM4_MOE_LAYER_TENSORS,
        check_glm4_moe,
        glm4_moe_metadata,
        padded=False,
        biases=("attention_bias",),
        fit_tensors=fit_glm4_moe_shared,
    ),
}
"""The families this module writes, by Hugging Face ``model_type``."""

ROPE_THETA: dict[str, Callable[[Any], float]] = {"olmo3": olmo3_rope_theta}

NOT_WRITTEN: dict[str, str] = {
    "deepseek_v3": "deepseek2 (latent attention with kv_b_proj split into k_b / v_b, grouped sigmoid routing)",
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
    "check_glm4_moe",
    "check_olmo3",
    "fit_glm4_moe_shared",
    "not_written",
]
