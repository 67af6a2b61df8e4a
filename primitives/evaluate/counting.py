"""Parameter and MAC counts, overall and per part of the model.

Parts: ``embeddings`` (token/position embeddings), ``attention`` (q, k, v, o), ``mlp``
(gate/up/down or fc1/fc2), ``norms``, ``head`` (an untied output head), ``other``. ``layers`` is
attention + mlp + norms inside the decoder/encoder layers. Tied weights count once.

MACs are counted for one forward pass over one sequence of ``seq_len`` tokens: every Linear in
the layers and the head costs in x out per token; attention adds QK^T and AV, ``heads x head_dim
x seq_len`` per token each (full, non-causal count). Embedding look-ups and norms are not counted.
"""

from __future__ import annotations

from slimkit.primitives.arch import ModelView
from torch import nn

PARTS = ("embeddings", "attention", "mlp", "norms", "head", "other")


def _numel(params, seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def params_by_part(model: nn.Module) -> dict[str, int]:
    view = ModelView(model)
    seen: set[int] = set()
    counts = dict.fromkeys(PARTS, 0)
    counts["embeddings"] = _numel(view.embed_tokens.parameters(), seen)
    for layer in view.layers:
        for role in layer.roles:
            part = "attention" if role in ("q", "k", "v", "o") else "mlp"
            counts[part] += _numel(layer.linear(role).parameters(), seen)
        counts["norms"] += _numel(layer.attn_norm.module.parameters(), seen)
        counts["norms"] += _numel(layer.mlp_norm.module.parameters(), seen)
        counts["other"] += _numel(layer.module.parameters(), seen)
    if view.final_norm is not None:
        counts["norms"] += _numel(view.final_norm.module.parameters(), seen)
    if view.head is not None:
        counts["head"] = _numel(view.head.parameters(), seen)
    # Position embeddings and anything else outside the layers.
    counts["other"] += _numel(model.parameters(), seen)
    counts["layers"] = sum(layer.num_params() for layer in view.layers)
    counts["total"] = sum(counts[p] for p in PARTS)
    return counts


def count_params(model: nn.Module) -> int:
    return params_by_part(model)["total"]


def count_macs(model: nn.Module, seq_len: int = 128) -> int:
    view = ModelView(model)
    per_token = 0
    attention = 0
    for layer in view.layers:
        for role in layer.roles:
            linear = layer.linear(role)
            per_token += sum(p.numel() for name, p in linear.named_parameters() if name.endswith("weight"))
        attention += 2 * layer.num_heads * layer.head_dim * seq_len
    if view.head is not None:
        per_token += view.head.weight.numel()
    return (per_token + attention) * seq_len
