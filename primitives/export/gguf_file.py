"""Write a compressed decoder as a GGUF file llama.cpp runs (``slimkit export --format gguf``).

Llama, Mistral, Qwen2/3 under llama.cpp's own names; Gemma 1-3, Granite and OLMo 2 under theirs (``gemma``,
``gemma2``, ``gemma3``, ``granite``, ``olmo2``), whose per-layer widths are padded exactly to one
(:mod:`.padding`) and whose fixed settings llama.cpp does not read are checked against the model.

Uniform and per-layer widths, low-rank pairs and optional biases; layers whose attention or MLP block was removed
(:mod:`slimkit.primitives.blocks`) as llama.cpp ``deci`` layers with zero heads or zero feed-forward width, which its
graph skips. What has no exact GGUF form is refused in one line.
The file is put in place in one step and never silently replaces another's file.

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from slimkit.primitives.arch.capabilities import rotary_fraction
from slimkit.primitives.arch.moe import MOE_SPECS, check_all_sparse, moe_spec
from slimkit.primitives.arch.spec import ARCH_SPECS, gguf_model_types
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.dense import DenseModel, dense_tensors
from slimkit.primitives.export.gguf_arch import (
    ATTENTION_TENSORS,
    FAMILIES,
    QK_NORM_TENSORS,
    ROPE_THETA,
    not_written,
)
from slimkit.primitives.export.gguf_vocab import vocabulary
from slimkit.primitives.export.padding import pad_to_uniform
from slimkit.primitives.files.atomic import staging_file

GGUF_TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
FALLBACK_TYPE = "f16"
EXPORTABLE_MODEL_TYPES = gguf_model_types()
"""Model types slimkit writes GGUF files of (:attr:`~slimkit.primitives.arch.spec.ArchSpec.gguf`)."""


_LAYER_TENSORS = {
    **ATTENTION_TENSORS,
    **QK_NORM_TENSORS,
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # a MoE MLP (qwen3moe): the router and the experts stacked (E, width, hidden) / (E, hidden, width)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    # Qwen2-MoE's shared expert and its sigmoid gate (a vector in llama.cpp)
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if not k.endswith("bias") and k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
"""Gemma 3's names: its ``post_attention_layernorm`` normalises the attention output (llama.cpp's
``post_attention_norm``), the MLP's input norm is ``pre_feedforward_layernorm``."""
_OLMO2_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if not k.endswith("bias") and "layernorm" not in k},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
"""OLMo 2's names: no input norms, branch post-norms, q/k norms over the whole projections."""
_PHI3_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
"""Phi-3's names: q/k/v fused (``attn_qkv``), gate and up fused (``ffn_up``, gate first)."""
_LAYER_MAPS = {
    **{ARCH_SPECS[model_type].gguf: family.layer_tensors for model_type, family in FAMILIES.items()},
    "gemma2": _GEMMA3_LAYER_TENSORS,
    "gemma3": _GEMMA3_LAYER_TENSORS,
    "olmo2": _OLMO2_LAYER_TENSORS,
    "phi3": _PHI3_LAYER_TENSORS,
}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
"""llama.cpp's Gemma architectures: norms written as ``1 + w`` (Hugging Face scales by ``1 + w``, llama.cpp by
``w``)."""
PADDED_ARCHITECTURES = (
    *GEMMA_ARCHITECTURES,
    "granite",
    "olmo2",
    "phi3",
    *(ARCH_SPECS[model_type].gguf for model_type, family in FAMILIES.items() if family.padded),
)
"""llama.cpp architectures whose tensors are all built from one head count and feed-forward length: per-layer
widths are padded to one (:mod:`slimkit.primitives.export.padding`), removed blocks refused."""
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}
"""llama.cpp's Gemma 2 / 3 read no layer types: every n-th layer attends to the whole context, the others to the
window."""
LARGEST_LAYERS = {"gemma2": 46, "gemma3": 62}
"""Layer counts of the 27B models, the only ones llama.cpp scales attention by 1/sqrt(hidden / heads)."""
GEMMA3_LOCAL_ROPE_BASE = 10000.0
"""llama.cpp's gemma3 RoPE base of the sliding-window layers (fixed; not read from the file)."""
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass
class GgufResult:
    """What :func:`write_gguf` wrote."""

    path: Path
    architecture: str
    type: str
    bytes: int
    tensors: int
    merged: list[str]
    added_params: int
    fallbacks: list[str] = field(default_factory=list)
    """``"blk.3.ffn_down.weight: rows of 1229 are not a multiple of 32, written as f16"``."""
    tokenizer_pre: str = "default"
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": "gguf",
            "path": str(self.path),
            "architecture": self.architecture,
            "type": self.type,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "merged": self.merged,
            "added_params": self.added_params,
            "fallbacks": self.fallbacks,
            "tokenizer_pre": self.tokenizer_pre,
            "warnings": self.warnings,
        }


ROPE_PERMUTED = ("llama", "deci", "granite")
"""llama.cpp architectures whose RoPE rotates adjacent pairs (llama.cpp's ``NORM`` type): q/k rows are permuted."""


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from Hugging Face's RoPE layout to llama.cpp's.

    Hugging Face rotates the two halves of each head (``rotate_half``: dimension ``j`` pairs with
    ``j + d/2``); llama.cpp's ``llama`` RoPE rotates adjacent pairs (``2j`` with ``2j + 1``). Within
    each head the rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` become ``[x_0, y_0, x_1, y_1, ...]``.
    Works on a weight (``heads * d x d_in``) and on a bias (``heads * d``).
    """
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows cannot be split into {heads} heads of even size")
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_architecture(model_type: str, uniform: bool) -> str:
    """llama.cpp's architecture for a model type and width pattern (one line when there is none): the family's own
    (:attr:`~slimkit.primitives.arch.spec.ArchSpec.gguf`) at uniform widths; with per-layer widths llama's ``deci``,
    the family's own when slimkit pads them to one width (:mod:`slimkit.primitives.export.padding`) or llama.cpp reads
    them per layer (the Mamba hybrids); refused for per-layer widths llama.cpp cannot read (Qwen2/3's, experts')."""
    from slimkit.primitives.export.gguf_hybrid import MAMBA_HYBRIDS, hybrid_refusal  # it imports this module

    spec = ARCH_SPECS.get(model_type)
    architecture = spec.gguf if spec is not None else None
    if spec is None or architecture is None:
        raise SlimkitError(
            not_written(model_type)
            or hybrid_refusal(model_type)
            or f"GGUF export supports model types {', '.join(EXPORTABLE_MODEL_TYPES)}; this model is '{model_type}'"
            + (" (an encoder: llama.cpp runs decoders)" if model_type == "bert" else "")
        )
    if uniform or model_type in MAMBA_HYBRIDS:  # llama.cpp's hybrids read per-layer arrays
        return architecture
    if spec.experts is not None:
        raise SlimkitError(
            f"per-layer expert counts or widths of a {model_type} model: llama.cpp reads one expert count and one "
            "expert width for every layer; prune with allocation: uniform, or serve it with slimkit.load"
        )
    if architecture == "llama":
        return "deci"
    if architecture in ("qwen2", "qwen3"):
        raise SlimkitError(
            f"per-layer widths of a {model_type} model: llama.cpp's deci architecture (the one with per-layer "
            f"widths) has no {'q/k/v biases' if model_type == 'qwen2' else 'q/k norms'}; serve it with slimkit.load"
        )
    return architecture  # per-layer widths padded to one (primitives/export/padding.py)


def check_exportable(model: nn.Module) -> list[str]:
    """One line when llama.cpp cannot run this model type / attention / RoPE configuration; else the
    warnings to report (what the file does not carry)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    gguf_architecture(model_type, uniform=True)
    if model_type in ("gemma", "gemma2", "gemma3_text"):
        return check_gemma(config, gguf_architecture(model_type, uniform=True))
    if model_type in FAMILIES:
        family = FAMILIES[model_type]
        unread = [k for k in ("attention_bias", "mlp_bias") if getattr(config, k, False) and k not in family.biases]
        if unread:
            raise SlimkitError(f"{', '.join(unread)}: llama.cpp's {ARCH_SPECS[model_type].gguf} reads no such biases")
        return family.check(config)
    warnings = []
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", True)
    if window is not None and use_window and window < config.max_position_embeddings:
        what = "is written, but llama.cpp's phi3 disables Phi's window" if model_type == "phi3" else "is not written"
        warnings.append(
            f"sliding_window {window} {what} (llama.cpp's {model_type} attends to the whole context): "
            f"outputs differ from the Hugging Face model beyond {window} tokens"
        )
    biased = getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
    if biased and model_type != "llama":
        raise SlimkitError(f"attention_bias / mlp_bias: slimkit's GGUF export writes them for llama, not {model_type}")
    check_moe(config)
    scaling = _rope_scaling(config)
    if scaling.get("rope_type", "default") not in ("default", "llama3", "linear"):
        raise SlimkitError(f"rope scaling '{scaling.get('rope_type')}' is not written by slimkit's GGUF export")
    return warnings


LLAMACPP_RENORMALISES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
"""Whether llama.cpp's MoE graph of each architecture renormalises the top-k routing weights (it reads no key)."""
QUERY_SPANS_HIDDEN = ("qwen2moe", "olmoe")
"""llama.cpp architectures that size the query projection (and OLMoE's q/k norms) by the hidden size."""


def check_moe(config: Any) -> None:
    """One line where llama.cpp's MoE graph would route otherwise than the Hugging Face model: the top-k weights
    renormalised or not, dense MLP layers among the MoE ones, OLMoE's clipped q/k/v."""
    model_type = getattr(config, "model_type", None) or ""
    moe, spec = MOE_SPECS.get(model_type), ARCH_SPECS.get(model_type)
    if moe is None or spec is None or spec.gguf is None:
        return
    architecture = spec.gguf
    check_all_sparse(config)
    renormalises = LLAMACPP_RENORMALISES[architecture]
    if moe.renormalises(config) != renormalises:
        raise SlimkitError(
            f"norm_topk_prob {str(not renormalises).lower()}: llama.cpp's {architecture} "
            f"{'always' if renormalises else 'never'} renormalises the top-k routing weights, so its outputs would "
            "differ; serve it with slimkit.load or transformers"
        )
    if getattr(config, "clip_qkv", None) is not None:
        raise SlimkitError(f"clip_qkv {config.clip_qkv}: llama.cpp's {architecture} does not clip q/k/v")


def query_width_refusal(widths: list[dict[str, int]], hidden_size: int, architecture: str) -> str | None:
    """Why llama.cpp's qwen2moe / olmoe cannot run these layer widths, or None: a layer's query heads do not span
    the hidden size (attention heads were removed), or an olmoe layer's key heads do not (grouped keys: llama.cpp
    sizes OLMoE's key norm by the hidden size)."""
    if architecture not in QUERY_SPANS_HIDDEN:
        return None
    for index, layer in enumerate(widths):
        query = layer["num_attention_heads"] * layer["head_dim"]
        key = layer["num_key_value_heads"] * layer["head_dim"]
        if query != hidden_size:
            return (
                f"layer {index}: query width {query} is not the hidden size {hidden_size}, which llama.cpp's "
                f"{architecture} requires (attention heads removed); prune experts or expert channels only, or serve "
                "it with slimkit.load"
            )
        if architecture == "olmoe" and key != hidden_size:
            return (
                f"layer {index}: key width {key} is not the hidden size {hidden_size}: llama.cpp's olmoe "
                "normalises keys over the hidden size (no grouped keys); serve it with slimkit.load"
            )
    return None


def check_shared_experts(dense: DenseModel) -> int | None:
    """The shared expert width every layer keeps (Qwen2-MoE), None without shared experts; one line when the widths
    differ (llama.cpp reads one)."""
    widths = {
        int(tensor.shape[0])
        for name, tensor in dense.tensors.items()
        if name.endswith("mlp.shared_expert.gate_proj.weight")
    }
    if len(widths) > 1:
        raise SlimkitError(
            f"shared expert widths {sorted(widths)} differ between layers: llama.cpp reads one; prune with "
            "allocation: uniform, or serve it with slimkit.load"
        )
    return widths.pop() if widths else None


def check_gemma(config: Any, architecture: str) -> list[str]:
    """One line where llama.cpp's gemma / gemma2 / gemma3 would compute something else than the Hugging Face model:
    the layer pattern, the sliding-window RoPE base and the attention scale it fixes instead of reading them, and
    soft-capping gemma3 does not apply."""
    if architecture == "gemma":
        return []
    layers = int(config.num_hidden_layers)
    every = SWA_PATTERNS[architecture]
    expected = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if list(config.layer_types) != expected:
        raise SlimkitError(
            f"layer_types: llama.cpp's {architecture} makes every {every}th layer full attention and the others "
            "sliding; this model's pattern differs, so its GGUF would compute other outputs"
        )
    head_dim = int(config.head_dim)
    if layers != LARGEST_LAYERS[architecture] and float(config.query_pre_attn_scalar) != head_dim:
        raise SlimkitError(
            f"query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp's {architecture} scales attention by "
            f"1/sqrt(head_dim {head_dim})"
        )
    params = getattr(config, "rope_parameters", None) or {}
    if architecture == "gemma2":
        if dict(params).get("rope_type", "default") != "default":
            raise SlimkitError(f"rope scaling '{params.get('rope_type')}' is not written by slimkit's GGUF export")
        return []
    local = params.get("sliding_attention", {}) if isinstance(params, dict) else {}
    base = float(local.get("rope_theta", getattr(config, "rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE)))
    if base != GEMMA3_LOCAL_ROPE_BASE or local.get("rope_type", "default") != "default":
        raise SlimkitError(
            f"sliding-window RoPE base {base:g} / type {local.get('rope_type')}: llama.cpp's gemma3 fixes "
            f"{GEMMA3_LOCAL_ROPE_BASE:g} and no scaling there"
        )
    full = params.get("full_attention", {}) if isinstance(params, dict) else {}
    if full.get("rope_type", "default") not in ("default", "linear"):
        raise SlimkitError(f"rope scaling '{full.get('rope_type')}' is not written by slimkit's GGUF export")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        raise SlimkitError("soft-capping: llama.cpp's gemma3 applies none")
    return []


def _rope_scaling(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def _rope_theta(config: Any) -> float:
    if config.model_type in ROPE_THETA:
        return ROPE_THETA[config.model_type](config)
    return float(_rope_scaling(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Llama 3.x's per-frequency RoPE divisors (llama.cpp's ``rope_freqs`` tensor)."""
    base = float(scaling.get("rope_theta", 10000.0))
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelengths = 2 * math.pi / freqs
    smooth = (context / wavelengths - low) / (high - low)
    factors = 1.0 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelengths < context / high, torch.ones_like(factors), factors)
    factors = torch.where(wavelengths > context / low, torch.full_like(factors, factor), factors)
    return factors.to(torch.float32)


def _gguf_name(name: str, architecture: str = "llama") -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".")
    layer_tensors = _LAYER_MAPS.get(architecture, _LAYER_TENSORS)
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        suffix = layer_tensors.get(".".join(parts[3:]))
        if suffix is not None:
            return f"blk.{int(parts[2])}.{suffix}"
    return None


_PHI3_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _phi3_rows(widths: dict[str, int], fused: str) -> list[int]:
    d = widths["head_dim"]
    if fused == "self_attn.qkv_proj":
        return [widths["num_attention_heads"] * d, *[widths["num_key_value_heads"] * d] * 2]
    return [widths["intermediate_size"]] * 2


def unfuse_phi3(dense: DenseModel) -> None:
    """Split each layer's fused ``qkv_proj`` / ``gate_up_proj`` of ``dense`` (in place) into Llama's names, by the
    layer's widths."""
    for index, widths in enumerate(dense.layer_widths):
        for fused, parts in _PHI3_FUSED.items():
            name = f"model.layers.{index}.{fused}.weight"
            if name in dense.tensors:
                pieces = dense.tensors.pop(name).split(_phi3_rows(widths, fused))
                for part, piece in zip(parts, pieces, strict=True):
                    dense.tensors[f"model.layers.{index}.{part}.weight"] = piece


def fuse_phi3(dense: DenseModel, only: tuple[str, ...] = tuple(_PHI3_FUSED)) -> None:
    """The inverse of :func:`unfuse_phi3`: Llama's names stacked back into ``qkv_proj`` and ``gate_up_proj`` (``only``
    those named: GLM-4 fuses gate and up alone)."""
    for index in range(len(dense.layer_widths)):
        for fused, parts in _PHI3_FUSED.items():
            if fused not in only:
                continue
            names = [f"model.layers.{index}.{part}.weight" for part in parts]
            if all(name in dense.tensors for name in names):
                dense.tensors[f"model.layers.{index}.{fused}.weight"] = torch.cat([dense.tensors.pop(n) for n in names])


def phi3_head_target(widths: list[dict[str, int]], hidden_size: int) -> tuple[int, int] | None:
    """The ``(query heads, KV heads)`` llama.cpp's phi3 needs every layer padded to, or None when none exists.

    Its graph takes K from the fused ``attn_qkv`` at offset ``n_embd``, so the query heads must span the hidden size
    (``hidden / head_dim`` heads); the KV heads are the fewest that divide them with every layer's KV heads and
    group fitting (:mod:`.padding` keeps each head in its KV group)."""
    live = [w for w in widths if w.get("num_attention_heads")]
    if not live:
        return None
    head_dim = live[0]["head_dim"]
    heads, remainder = divmod(hidden_size, head_dim)
    kv_max = max(w["num_key_value_heads"] for w in live)
    group = max(w["num_attention_heads"] // w["num_key_value_heads"] for w in live)
    if remainder:
        return None
    for kv in range(kv_max, heads + 1):
        if heads % kv == 0 and heads // kv >= group:
            return heads, kv
    return None


def phi3_head_refusal(widths: list[dict[str, int]], hidden_size: int) -> str | None:
    """Why llama.cpp's phi3 cannot read these per-layer widths exactly (one line), or None."""
    if phi3_head_target(widths, hidden_size) is not None:
        return None
    live = [w for w in widths if w.get("num_attention_heads")]
    shapes = sorted({(w["num_attention_heads"], w["num_key_value_heads"], w["head_dim"]) for w in live})
    return (
        f"attention of {', '.join(f'{h} heads over {kv} KV heads of {d}' for h, kv, d in shapes)} cannot be padded to "
        f"query heads spanning the hidden size {hidden_size} with every head in its KV group, which llama.cpp's phi3 "
        "graph needs (it cuts its fused attn_qkv at the hidden size); use --format hf or slimkit.load"
    )


def check_phi3_heads(dense: DenseModel) -> tuple[int, int]:
    """The head counts to pad to (:func:`phi3_head_target`), or one line where there are none."""
    target = phi3_head_target(dense.layer_widths, dense.hidden_size)
    if target is None:
        raise SlimkitError(phi3_head_refusal(dense.layer_widths, dense.hidden_size) or "")
    return target


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each fused ``mlp.experts.gate_up_proj`` (E, 2 x width, hidden) split into the stacked
    ``mlp.experts.gate_proj`` and ``mlp.experts.up_proj`` (E, width, hidden) that llama.cpp reads."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj"], out[stem + "up_proj"] = gate, up
        else:
            out[name] = tensor
    return out


def _encode(
    array: np.ndarray, name: str, wanted: str, fallbacks: list[str]
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """``array`` (float32) in the wanted type; 1-D tensors stay f32; q8_0 falls back per tensor."""
    if array.ndim == 1 or wanted == "f32":
        return array, gguf.GGMLQuantizationType.F32
    qtype = GGUF_TYPES[wanted]
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), qtype
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.shape[-1] % block:
        fallbacks.append(f"{name}: rows of {array.shape[-1]} are not a multiple of {block}, written as {FALLBACK_TYPE}")
        return array.astype(np.float16), GGUF_TYPES[FALLBACK_TYPE]
    return gguf.quants.quantize(array, qtype), qtype


def _metadata(writer: gguf.GGUFWriter, model: nn.Module, dense: DenseModel, name: str, architecture: str) -> None:
    config = model.config
    widths = dense.layer_widths
    head_dim = widths[0]["head_dim"]
    writer.add_name(name)
    writer.add_block_count(len(widths))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(dense.hidden_size)
    if architecture in GEMMA_ARCHITECTURES:
        _gemma_metadata(writer, config, dense, architecture)
        return
    moe = moe_spec(model)
    if moe is not None:  # every layer a MoE layer: the expert width is the feed-forward width
        shared = check_shared_experts(dense)
        if shared is not None:  # qwen2moe: n_ff is the fallback of the shared width
            writer.add_feed_forward_length(shared)
            writer.add_expert_shared_feed_forward_length(shared)
        elif architecture in ("qwen3moe", "olmoe"):  # olmoe reads the expert width as n_ff
            writer.add_feed_forward_length(widths[0][moe.width_key])
        writer.add_expert_feed_forward_length(widths[0][moe.width_key])
        writer.add_expert_count(widths[0][moe.count_key])
        writer.add_expert_used_count(int(config.num_experts_per_tok))
    if architecture in ("qwen3moe", "qwen2moe", "olmoe"):
        writer.add_head_count(widths[0]["num_attention_heads"])
        writer.add_head_count_kv(widths[0]["num_key_value_heads"])
    elif architecture != "deci":
        writer.add_feed_forward_length(widths[0]["intermediate_size"])
        writer.add_head_count(widths[0]["num_attention_heads"])
        writer.add_head_count_kv(widths[0]["num_key_value_heads"])
    else:
        writer.add_feed_forward_length([w["intermediate_size"] for w in widths])
        writer.add_head_count([w["num_attention_heads"] for w in widths])
        writer.add_head_count_kv([w["num_key_value_heads"] for w in widths])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    spec = ARCH_SPECS[config.model_type]
    writer.add_rope_dimension_count(int(head_dim * rotary_fraction(spec, config)))  # Phi-4-mini rotates 3/4
    writer.add_rope_freq_base(_rope_theta(config))
    if architecture == "phi3":  # llama.cpp's phi3 reads the key (0: no window)
        writer.add_sliding_window(int(getattr(config, "sliding_window", None) or 0))
    if config.model_type in FAMILIES:
        FAMILIES[config.model_type].metadata(writer, config, dense.tensors)
    scaling = _rope_scaling(config)
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(dense.tensors["model.embed_tokens.weight"].shape[0]))
    if architecture == "granite":  # the multipliers as llama.cpp's scales
        writer.add_attention_scale(float(config.attention_multiplier))
        writer.add_embedding_scale(float(config.embedding_multiplier))
        writer.add_residual_scale(float(config.residual_multiplier))
        writer.add_logit_scale(float(config.logits_scaling))


def _gemma_metadata(writer: gguf.GGUFWriter, config: Any, dense: DenseModel, architecture: str) -> None:
    """The Gemma keys: one head count and feed-forward length (widths are padded to one before), the window and
    soft-capping (gemma2), the full-attention layers' RoPE base and linear scaling (gemma3)."""
    widths = dense.layer_widths
    head_dim = widths[0]["head_dim"]
    writer.add_feed_forward_length(widths[0]["intermediate_size"])
    writer.add_head_count(widths[0]["num_attention_heads"])
    writer.add_head_count_kv(widths[0]["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(int(config.sliding_window))
        full = (getattr(config, "rope_parameters", None) or {}).get("full_attention", {})
        writer.add_rope_freq_base(float(full.get("rope_theta", getattr(config, "rope_theta", 1_000_000.0))))
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(full["factor"]))
    else:
        writer.add_rope_freq_base(_rope_theta(config))
    if architecture == "gemma2":
        writer.add_sliding_window(int(config.sliding_window))
        if config.attn_logit_softcapping:
            writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(dense.tensors["model.embed_tokens.weight"].shape[0]))


def zero_first_attention(dense: DenseModel) -> str:
    """Give layer 0, whose attention block was removed, one attention head with zero weights; returns the note.

    llama.cpp reads the head width (``key_length``) only when layer 0 has heads, and a deci file whose first layer
    has none does not load ("tensor 'blk.1.attn_q.weight' has wrong shape"). One head whose value and output
    projections are zero adds exactly nothing to the residual stream (uniform attention over zero values), so the
    logits are unchanged; it costs ``4 x hidden x head_dim + hidden`` parameters in the file."""
    widths = dense.layer_widths[0]
    hidden, head_dim = dense.hidden_size, widths["head_dim"]
    prefix = "model.layers.0."
    placeholder = {
        "input_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": torch.zeros(head_dim, hidden),
        "self_attn.k_proj.weight": torch.zeros(head_dim, hidden),
        "self_attn.v_proj.weight": torch.zeros(head_dim, hidden),
        "self_attn.o_proj.weight": torch.zeros(hidden, head_dim),
    }
    for name, tensor in placeholder.items():
        dense.tensors[prefix + name] = tensor
    dense.layer_widths[0] = {**widths, "num_attention_heads": 1, "num_key_value_heads": 1}
    added = sum(tensor.numel() for tensor in placeholder.values())
    dense.added_params += added
    return (
        f"layer 0's attention block was removed: written as one attention head with zero weights ({added} "
        "parameters), since llama.cpp cannot load a first layer without heads; it adds nothing to the output"
    )


def zero_feed_forwards(dense: DenseModel, layers: list[int]) -> str:
    """Give ``layers``, whose MLP block was removed, a feed-forward of width 1 with zero weights; returns the note.

    llama.cpp's deci graph skips a layer with ``feed_forward_length`` 0 by leaving the loop before the layer's result
    becomes the next layer's input, which drops the layer's attention output (measured: the logits then equal those
    of the model without that attention) and, in the last layer, aborts. A zero FFN adds exactly nothing and keeps
    the attention. A layer without attention and without MLP (not the last) keeps width 0: nothing is dropped."""
    hidden = dense.hidden_size
    added = 0
    for index in layers:
        placeholder = {
            "post_attention_layernorm.weight": torch.ones(hidden),
            "mlp.gate_proj.weight": torch.zeros(1, hidden),
            "mlp.up_proj.weight": torch.zeros(1, hidden),
            "mlp.down_proj.weight": torch.zeros(hidden, 1),
        }
        for name, tensor in placeholder.items():
            dense.tensors[f"model.layers.{index}.{name}"] = tensor
        dense.layer_widths[index] = {**dense.layer_widths[index], "intermediate_size": 1}
        added += sum(tensor.numel() for tensor in placeholder.values())
    dense.added_params += added
    return (
        f"the MLP blocks of layers {', '.join(map(str, layers))} were removed: written as feed-forwards of width 1 "
        f"with zero weights ({added} parameters), since llama.cpp's deci graph drops the attention output of a layer "
        "with feed-forward length 0; they add nothing to the output"
    )


def finish_file(writer: gguf.GGUFWriter, staging: Path, target: Path, replace: bool) -> None:
    """Write ``writer``'s header, metadata and tensors to ``staging``, close it and put it at ``target``
    (:func:`place_file`)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    place_file(staging, target, replace)


def place_file(staging: Path, target: Path, replace: bool) -> None:
    """Put the finished ``staging`` file at ``target`` in one step; without ``replace`` never over an existing
    name (one :class:`SlimkitError` line then, ``staging`` left for the caller to delete)."""
    if replace:
        os.replace(staging, target)
        return
    try:
        os.link(staging, target, follow_symlinks=False)
    except FileExistsError:
        raise SlimkitError(
            f"{target} appeared while this export ran (another process wrote it); it was left as it is: pass "
            "--force to replace it"
        ) from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        except FileExistsError:
            raise SlimkitError(
                f"{target} appeared while this export ran (another process wrote it); it was left as it is: pass "
                "--force to replace it"
            ) from None
        os.replace(staging, target)
        return
    staging.unlink()


def write_gguf(
    model: nn.Module,
    tokenizer: Any,
    path: str | os.PathLike,
    type: str = "f16",
    name: str | None = None,
    replace: bool = False,
) -> GgufResult:
    """Write ``model`` (a loaded Llama-family decoder) and its tokenizer to ``path`` as GGUF.

    Every check that can fail (model type, merges, tokenizer, type) runs before anything is written;
    the file appears at ``path`` only when complete, over an existing file only with ``replace``
    (:func:`place_file`).
    """
    if type not in GGUF_TYPES:
        raise SlimkitError(f"GGUF type '{type}' is not one of {', '.join(GGUF_TYPES)}")
    from slimkit.primitives.export.gguf_hybrid import MAMBA_HYBRIDS, hybrid_refusal, write_hybrid_gguf

    hybrid = hybrid_refusal(model.config.model_type)  # hybrids: their own writer, or one line
    if hybrid is not None:
        raise SlimkitError(hybrid)
    if model.config.model_type in MAMBA_HYBRIDS:
        return write_hybrid_gguf(model, tokenizer, path, type, name, replace)
    warnings = check_exportable(model)
    dense = dense_tensors(model)
    if model.config.model_type in FAMILIES:  # widths llama.cpp reads otherwise: padded, or one line before writing
        note = FAMILIES[model.config.model_type].fit_tensors(dense, model.config)
        if note is not None:
            warnings.append(note)
    widths = dense.layer_widths
    # A removed block is a zero in deci's per-layer head / feed-forward arrays, which llama.cpp's deci graph skips.
    ffn = ARCH_SPECS[model.config.model_type].intermediate_size_key  # a MoE model's: the expert width
    removed = any(w["num_attention_heads"] == 0 or w[ffn] == 0 for w in widths)
    architecture = gguf_architecture(model.config.model_type, dense.uniform and not removed)
    if removed and architecture in PADDED_ARCHITECTURES:
        raise SlimkitError(
            f"removed attention / MLP blocks: llama.cpp's {architecture} graph runs every layer's attention and MLP "
            "(it has no per-layer skip like deci's); serve it with slimkit.load"
        )
    heads, kept_heads = None, max(w["num_attention_heads"] for w in widths)
    refusal = query_width_refusal(dense.layer_widths, dense.hidden_size, architecture)
    if refusal is not None:
        raise SlimkitError(refusal)
    if architecture in QUERY_SPANS_HIDDEN:  # llama.cpp's graph reads a head tensor even for a tied model
        check_shared_experts(dense)
        if dense.tied:
            dense.tensors["lm_head.weight"] = dense.tensors["model.embed_tokens.weight"]
            dense.tied = False
    fused_mlp = model.config.model_type in FAMILIES and FAMILIES[model.config.model_type].fused_mlp
    if architecture == "phi3":
        heads = check_phi3_heads(dense)  # the query heads must span the hidden size
    if architecture == "phi3" or fused_mlp:
        unfuse_phi3(dense)  # Llama's names, which the padding reads
    if architecture in PADDED_ARCHITECTURES:
        note = pad_to_uniform(dense, heads)  # llama.cpp builds every layer's tensors from one width
        if note is not None:
            warnings.append(note)
    if architecture == "phi3":
        fuse_phi3(dense)
    elif fused_mlp:
        fuse_phi3(dense, only=("mlp.gate_up_proj",))
    if architecture == "phi3":
        if heads is not None and heads[0] > kept_heads:
            warnings.append(
                f"query heads padded back to {heads[0]} (hidden size / head_dim), which llama.cpp's phi3 graph needs: "
                "the pruned heads save no compute there"
            )
    permute = architecture in ROPE_PERMUTED  # the others use llama.cpp's NEOX RoPE: Hugging Face's layout
    norm_offset = (
        1.0 if architecture in GEMMA_ARCHITECTURES else 0.0
    )  # Gemma's norms scale by (1 + w); llama.cpp's by w
    if widths[0]["num_attention_heads"] == 0:
        warnings.append(zero_first_attention(dense))
    last = len(widths) - 1
    ffn_free = [i for i, w in enumerate(widths) if w[ffn] == 0]
    kept = [i for i in ffn_free if widths[i]["num_attention_heads"] > 0 or i == last]
    if kept:
        warnings.append(zero_feed_forwards(dense, kept))
    vocab = vocabulary(tokenizer, int(dense.tensors["model.embed_tokens.weight"].shape[0]))
    if vocab.warning:
        warnings.append(vocab.warning)
    target = Path(path)
    staging = staging_file(target)
    fallbacks: list[str] = []
    writer = gguf.GGUFWriter(staging, architecture, use_temp_file=True)
    try:
        _metadata(writer, model, dense, name or target.stem, architecture)
        writer.add_file_type(_FILE_TYPES[type])
        vocab.add_to(writer)
        scaling = _rope_scaling(model.config)
        count = 0
        if scaling.get("rope_type") == "llama3":
            writer.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, widths[0]["head_dim"]).numpy())
            count += 1
        for hf_name, tensor in split_experts(dense.tensors).items():
            gguf_name = _gguf_name(hf_name, architecture)
            if gguf_name is None:
                raise SlimkitError(f"tensor '{hf_name}' has no GGUF name in slimkit's {architecture} mapping")
            weight = tensor.detach().to("cpu", torch.float32)
            if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
                weight = weight.reshape(-1)  # Linear(hidden, 1): the vector llama.cpp reads
            if norm_offset and gguf_name.endswith("norm.weight"):
                weight = weight + norm_offset
            layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else None
            if permute and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
                weight = rope_permute(weight, widths[layer]["num_attention_heads"])
            elif permute and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
                weight = rope_permute(weight, widths[layer]["num_key_value_heads"])
            data, qtype = _encode(weight.numpy(), gguf_name, type, fallbacks)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            count += 1
        finish_file(writer, staging, target, replace)
    finally:
        writer.close()
        staging.unlink(missing_ok=True)
    return GgufResult(
        path=target,
        architecture=architecture,
        type=type,
        bytes=target.stat().st_size,
        tensors=count,
        merged=dense.merged,
        added_params=dense.added_params,
        fallbacks=fallbacks,
        tokenizer_pre=vocab.pre,
        warnings=warnings,
    )


FILE_TYPES = _FILE_TYPES
"""GGUF's file type of each ``--type`` (for the writers beside this one)."""
encode_tensor = _encode
"""A tensor in the file's type (for the writers beside this one: :mod:`.gguf_hybrid`)."""


__all__ = [
    "EXPORTABLE_MODEL_TYPES",
    "FILE_TYPES",
    "GGUF_TYPES",
    "GgufResult",
    "check_exportable",
    "check_moe",
    "check_phi3_heads",
    "check_shared_experts",
    "encode_tensor",
    "fuse_phi3",
    "gguf_architecture",
    "llama3_rope_factors",
    "phi3_head_refusal",
    "phi3_head_target",
    "query_width_refusal",
    "rope_permute",
    "split_experts",
    "unfuse_phi3",
    "write_gguf",
    "zero_feed_forwards",
    "zero_first_attention",
]
