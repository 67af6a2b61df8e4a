"""GGUF files of the Mamba-2 hybrids (llama.cpp's ``nemotron_h`` and ``granitehybrid``), as llama.cpp's converter writes
them; the gated DeltaNet hybrids are refused in one line.

Tensor names come from the ``gguf`` package's own map of each architecture (its Hugging Face names, after the
checkpoint renames below); what is written as llama.cpp reads it: ``A = -exp(A_log)`` and ``D`` as ``(heads, 1)``,
the convolution as ``(channels, kernel)``, the gated norm as ``(groups, channels / group)``, ``dt_bias`` as
``ssm_dt.bias``. llama.cpp reads one Mamba-2 width and one query-head count for the model: they must agree across
layers (per-layer MLP widths and KV heads are arrays). Checked against llama.cpp's logits on tiny models
(tests/primitives/export/test_gguf_hybrids.py). Method note: docs/methods/architectures.md (per-layer kinds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.mixers import Mamba2View
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export.dense import DenseModel, dense_tensors
from slimkit.primitives.export.gguf_file import FILE_TYPES, GgufResult, encode_tensor, finish_file
from slimkit.primitives.export.gguf_vocab import vocabulary
from slimkit.primitives.files.atomic import staging_file

MAMBA_HYBRIDS = {"nemotron_h": gguf.MODEL_ARCH.NEMOTRON_H, "granitemoehybrid": gguf.MODEL_ARCH.GRANITE_HYBRID}
"""Model types written as GGUF here, and llama.cpp's architecture for each."""
NOT_WRITTEN = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
"""Hybrids llama.cpp has an architecture for that slimkit does not write: its converter reorders the DeltaNet value
heads for its broadcast and writes multi-section RoPE, which no test here checks against llama.cpp yet."""
_RENAMES = {
    "nemotron_h": (("model.", "backbone."),),  # the checkpoint's prefix, which the gguf map knows
    "granitemoehybrid": (),
}


def hybrid_refusal(model_type: str) -> str | None:
    """Why a hybrid is not written as GGUF (one line), or None for one this module writes (or a non-hybrid)."""
    if model_type in NOT_WRITTEN:
        return (
            f"GGUF export of {model_type} is not written by slimkit: llama.cpp's {NOT_WRITTEN[model_type]} reads its "
            "gated DeltaNet heads reordered and multi-section RoPE, which slimkit does not write yet; use --format hf"
        )
    return None


def _uniform(values: list[int], what: str, architecture: str) -> int:
    kinds = sorted(set(values))
    if len(kinds) != 1:
        raise SlimkitError(
            f"{what} differ between layers ({', '.join(map(str, kinds))}): llama.cpp's {architecture} reads one for "
            "the model; prune them uniformly, or serve it with slimkit.load"
        )
    return kinds[0]


def _check_config(model: nn.Module, architecture: str) -> None:
    config = model.config
    if architecture == "nemotron_h" and getattr(config, "mlp_hidden_act", "relu2") != "relu2":
        raise SlimkitError(f"mlp_hidden_act {config.mlp_hidden_act}: llama.cpp's nemotron_h computes relu^2")
    if architecture == "granitehybrid" and getattr(config, "position_embedding_type", None) not in (None, "nope"):
        raise SlimkitError(
            f"position_embedding_type {config.position_embedding_type}: llama.cpp's granitehybrid applies no RoPE to "
            "a hybrid's attention"
        )


def _metadata(writer: gguf.GGUFWriter, model: nn.Module, view: ModelView, dense: DenseModel, arch: str) -> None:
    config = model.config
    layers = view.layers
    mixers = [layer.mixer for layer in layers if isinstance(layer.mixer, Mamba2View)]
    attention = [layer for layer in layers if layer.has_attention]
    width = _uniform([m.intermediate_size for m in mixers], "Mamba-2 widths (heads x head_dim)", arch)
    heads = _uniform([m.num_heads for m in mixers], "Mamba-2 head counts", arch)
    groups = _uniform([m.num_groups for m in mixers], "Mamba-2 SSM group counts", arch)
    if arch == "granitehybrid" and width != 2 * dense.hidden_size:
        raise SlimkitError(
            f"Mamba-2 width {width}: llama.cpp's granitehybrid graph requires twice the hidden size "
            f"({2 * dense.hidden_size}), so Mamba heads or channels removed cannot be run there; keep them, or use "
            "--format hf or slimkit.load"
        )
    query = _uniform([layer.num_heads for layer in attention], "attention query-head counts", arch)
    head_dim = _uniform([layer.head_dim for layer in attention], "attention head widths", arch)
    writer.add_block_count(len(layers))
    writer.add_context_length(int(getattr(config, "max_position_embeddings", 4096)))
    writer.add_embedding_length(dense.hidden_size)
    ffn = [layer.mlp_width for layer in layers]
    writer.add_feed_forward_length(max(ffn) if arch == "granitehybrid" else ffn)  # granitehybrid: one (padded)
    writer.add_head_count(query)
    writer.add_head_count_kv([layer.num_kv_heads for layer in layers])  # 0: a Mamba (or MLP) layer
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_ssm_conv_kernel(int(mixers[0].module.conv_kernel_size))
    writer.add_ssm_inner_size(width)
    writer.add_ssm_state_size(mixers[0].state_size)
    writer.add_ssm_time_step_rank(heads)
    writer.add_ssm_group_count(groups)
    eps = float(getattr(config, "layer_norm_epsilon", None) or config.rms_norm_eps)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_layer_norm_eps(eps)  # llama.cpp's nemotron_h reads this key as well
    writer.add_vocab_size(int(view.embed_tokens.weight.shape[0]))
    if arch == "granitehybrid":  # Granite's multipliers as llama.cpp's scales; no RoPE in a hybrid
        writer.add_attention_scale(float(config.attention_multiplier))
        writer.add_embedding_scale(float(config.embedding_multiplier))
        writer.add_residual_scale(float(config.residual_multiplier))
        writer.add_logit_scale(float(config.logits_scaling))
        writer.add_expert_shared_feed_forward_length(max(layer.mlp_width for layer in layers))
        writer.add_rope_scaling_finetuned(False)


def _hf_tensors(model_type: str, dense: DenseModel, view: ModelView) -> dict[str, torch.Tensor]:
    """The dense tensors under the names the gguf map knows, in the shapes llama.cpp reads."""
    groups = {layer.index: layer.mixer.num_groups for layer in view.layers if isinstance(layer.mixer, Mamba2View)}
    kinds = view.spec.layer_kinds
    mixer_path = kinds.mamba.path if kinds is not None and kinds.mamba is not None else "mixer"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in dense.tensors.items():
        weight = tensor.detach().to("cpu", torch.float32)
        for old, new in _RENAMES[model_type]:
            name = new + name[len(old) :] if name.startswith(old) else name
        layer = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith(".A_log"):
            weight = (-torch.exp(weight)).reshape(-1, 1)
        elif name.endswith(".D"):
            weight = weight.reshape(-1, 1)
        elif name.endswith("conv1d.weight"):
            weight = weight.squeeze(1)
        elif layer in groups and name.endswith(f".{mixer_path}.norm.weight"):
            weight = weight.reshape(groups[layer], -1)  # the gated norm, one row per SSM group
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if name.endswith("shared_mlp.input_linear.weight"):  # Granite's fused gate and up (gate first)
            gate, up = weight.chunk(2, dim=0)
            stem = name.removesuffix("shared_mlp.input_linear.weight")
            out[stem + "mlp.gate_proj.weight"], out[stem + "mlp.up_proj.weight"] = gate, up
            continue
        if name.endswith("shared_mlp.output_linear.weight"):
            name = name.removesuffix("shared_mlp.output_linear.weight") + "mlp.down_proj.weight"
        out[name] = weight
    return out


def pad_feed_forwards(tensors: dict[str, torch.Tensor], width: int) -> int:
    """Pad every gated MLP of ``tensors`` (``mlp.gate_proj`` / ``up_proj`` rows, ``down_proj`` columns) with zeros to
    ``width`` channels, in place; returns the parameters added. A zero channel adds ``down @ (act(0) * 0) = 0``, so the
    outputs are unchanged (llama.cpp's granitehybrid reads one feed-forward width)."""
    added = 0
    for name in [n for n in tensors if n.endswith("mlp.down_proj.weight")]:
        stem = name.removesuffix("down_proj.weight")
        down = tensors[name]
        missing = width - int(down.shape[1])
        if missing <= 0:
            continue
        tensors[name] = torch.cat([down, down.new_zeros(down.shape[0], missing)], dim=1)
        for role in ("gate_proj", "up_proj"):
            rows = tensors[f"{stem}{role}.weight"]
            tensors[f"{stem}{role}.weight"] = torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])
        added += 3 * missing * int(down.shape[0])
    return added


def write_hybrid_gguf(
    model: nn.Module, tokenizer: Any, path: str | os.PathLike, type: str, name: str | None, replace: bool
) -> GgufResult:
    """Write a Mamba-2 hybrid (:data:`MAMBA_HYBRIDS`) to ``path`` as GGUF: every check before anything is written,
    the file put in place when complete (as :func:`~slimkit.primitives.export.gguf_file.write_gguf` does)."""
    model_type = model.config.model_type
    arch = MAMBA_HYBRIDS[model_type]
    architecture = gguf.MODEL_ARCH_NAMES[arch]
    _check_config(model, architecture)
    view = ModelView(model)
    if any(layer.removed_blocks for layer in view.layers):
        raise SlimkitError(f"removed blocks: llama.cpp's {architecture} builds every layer of its kind")
    dense = dense_tensors(model)
    tensors = _hf_tensors(model_type, dense, view)
    warnings = []
    widths = sorted({layer.mlp_width for layer in view.layers if layer.has_mlp})
    if architecture == "granitehybrid" and len(widths) > 1:  # one feed-forward width there: pad exactly
        added = pad_feed_forwards(tensors, widths[-1])
        dense.added_params += added
        warnings.append(
            f"MLP widths {', '.join(map(str, widths))} padded with zero channels to {widths[-1]} ({added} parameters), "
            "since llama.cpp's granitehybrid reads one feed-forward width; the outputs are unchanged"
        )
    names = gguf.get_tensor_name_map(arch, view.num_layers)
    mapped: list[tuple[str, torch.Tensor]] = []
    for hf_name, tensor in tensors.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise SlimkitError(f"tensor '{hf_name}' has no GGUF name in llama.cpp's {architecture} map")
        mapped.append((gguf_name, tensor))
    vocab = vocabulary(tokenizer, int(view.embed_tokens.weight.shape[0]))
    target = Path(path)
    staging = staging_file(target)
    fallbacks: list[str] = []
    writer = gguf.GGUFWriter(staging, architecture, use_temp_file=True)
    try:
        writer.add_name(name or target.stem)
        _metadata(writer, model, view, dense, architecture)
        writer.add_file_type(FILE_TYPES[type])
        vocab.add_to(writer)
        for gguf_name, tensor in mapped:
            data, qtype = encode_tensor(tensor.numpy(), gguf_name, type, fallbacks)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        finish_file(writer, staging, target, replace)
    finally:
        writer.close()
        staging.unlink(missing_ok=True)
    return GgufResult(
        path=target,
        architecture=architecture,
        type=type,
        bytes=target.stat().st_size,
        tensors=len(mapped),
        merged=dense.merged,
        added_params=dense.added_params,
        fallbacks=fallbacks,
        tokenizer_pre=vocab.pre,
        warnings=warnings + ([vocab.warning] if vocab.warning else []),
    )


__all__ = ["MAMBA_HYBRIDS", "NOT_WRITTEN", "hybrid_refusal", "write_hybrid_gguf"]
