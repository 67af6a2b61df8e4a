"""Per-layer widths padded with zeros to one width, for GGUF architectures that read a single head count and
feed-forward length (llama.cpp's gemma3 builds every layer's tensors from layer 0's widths).

The padding is exact: an MLP channel whose gate and up rows are zero yields ``act(0) * 0 = 0`` (GELU, SiLU) and its
zero ``down`` column adds nothing; a padded query head has zero ``q`` rows and a zero ``o_proj`` column, so whatever
it attends to is multiplied by zero; a padded KV group has zero ``k``/``v`` rows and only padded query heads. Heads
keep their KV group: each group is padded to the largest group size, then whole groups are added. The file is then
as large and as slow as the widest layer (the padding is counted in ``added_params``).

Method note: docs/methods/export-gguf.md.
"""

from __future__ import annotations

import torch

from slimkit.primitives.export.dense import DenseModel

_ATTENTION = "self_attn"


def _rows(weight: torch.Tensor, units: int, width: int, kept: list[int]) -> torch.Tensor:
    """``weight``'s row blocks of ``width`` placed at unit positions ``kept`` among ``units`` (zeros elsewhere)."""
    out = weight.new_zeros(units * width, *weight.shape[1:])
    for source, target in enumerate(kept):
        out[target * width : (target + 1) * width] = weight[source * width : (source + 1) * width]
    return out


def _cols(weight: torch.Tensor, units: int, width: int, kept: list[int]) -> torch.Tensor:
    return _rows(weight.T, units, width, kept).T.contiguous()


def pad_to_uniform(dense: DenseModel, at_least: tuple[int, int] | None = None) -> str | None:
    """Pad every layer of ``dense`` (in place) to the largest MLP width and GQA shape; returns the note, or None when
    the widths are already uniform. Layers must all have heads and an MLP (removed blocks are refused before).

    ``at_least``: ``(query heads, KV heads)`` the attention is padded to at least (an engine that needs a head count,
    llama.cpp's phi3); the KV heads must divide the query heads."""
    widths = dense.layer_widths
    kv_max = max(w["num_key_value_heads"] for w in widths)
    group = max(w["num_attention_heads"] // w["num_key_value_heads"] for w in widths)
    if at_least is not None:
        kv_max, group = max(kv_max, at_least[1]), max(group, at_least[0] // at_least[1])
    heads = kv_max * group
    if dense.uniform and (widths[0]["num_attention_heads"], widths[0]["num_key_value_heads"]) == (heads, kv_max):
        return None
    ffn = max(w["intermediate_size"] for w in widths)
    added = 0
    for index, w in enumerate(widths):
        prefix = f"model.layers.{index}."
        t = dense.tensors
        before = sum(t[prefix + n].numel() for n in _names() if prefix + n in t)
        width = w["intermediate_size"]
        if width < ffn:
            kept = list(range(width))
            for role in ("gate_proj", "up_proj"):
                t[f"{prefix}mlp.{role}.weight"] = _rows(t[f"{prefix}mlp.{role}.weight"], ffn, 1, kept)
            t[f"{prefix}mlp.down_proj.weight"] = _cols(t[f"{prefix}mlp.down_proj.weight"], ffn, 1, kept)
        h, kv, d = w["num_attention_heads"], w["num_key_value_heads"], w["head_dim"]
        if (h, kv) != (heads, kv_max):
            g = h // kv
            q_kept = [j * group + i for j in range(kv) for i in range(g)]
            t[f"{prefix}{_ATTENTION}.q_proj.weight"] = _rows(t[f"{prefix}{_ATTENTION}.q_proj.weight"], heads, d, q_kept)
            t[f"{prefix}{_ATTENTION}.o_proj.weight"] = _cols(t[f"{prefix}{_ATTENTION}.o_proj.weight"], heads, d, q_kept)
            if f"{prefix}{_ATTENTION}.q_proj.bias" in t:  # a padded head's bias is zero too (GLM-4's q/k/v biases)
                t[f"{prefix}{_ATTENTION}.q_proj.bias"] = _rows(t[f"{prefix}{_ATTENTION}.q_proj.bias"], heads, d, q_kept)
            for role in ("k_proj", "v_proj"):
                for param in ("weight", "bias"):
                    name = f"{prefix}{_ATTENTION}.{role}.{param}"
                    if name in t:
                        t[name] = _rows(t[name], kv_max, d, list(range(kv)))
        added += sum(t[prefix + n].numel() for n in _names() if prefix + n in t) - before
        widths[index] = {**w, "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv_max}
    dense.added_params += added
    return (
        f"per-layer widths padded with zeros to {heads} query heads over {kv_max} KV heads and {ffn} MLP channels in "
        f"every layer ({added} parameters): the GGUF architecture reads one width for all layers; exact, but as large "
        "and as slow as the widest layer"
    )


def _names() -> tuple[str, ...]:
    return (
        tuple(f"{_ATTENTION}.{r}.weight" for r in ("q_proj", "k_proj", "v_proj", "o_proj"))
        + tuple(f"mlp.{r}.weight" for r in ("gate_proj", "up_proj", "down_proj"))
        + tuple(f"{_ATTENTION}.{r}.bias" for r in ("q_proj", "k_proj", "v_proj"))
    )


__all__ = ["pad_to_uniform"]
