"""Parameter and MAC counts, overall and per part of the model.

Parts: ``embeddings`` (token/position embeddings), ``attention`` (q, k, v, o), ``mlp``
(gate/up/down or fc1/fc2), ``norms``, ``head`` (an untied output head), ``other``. ``layers`` is
attention + mlp + norms inside the decoder/encoder layers. Tied weights count once.

MACs are counted for one forward pass over one sequence of ``seq_len`` tokens: every Linear in
the layers and the head costs in x out per token; attention adds QK^T and AV, ``heads x head_dim
x seq_len`` per token each (full, non-causal count); SP3's residual / basis-change matrices cost
in x out per token. Embedding look-ups and norms are not counted.
"""

from __future__ import annotations

from torch import nn

from slimkit.primitives.arch import ModelView

PARTS = ("embeddings", "attention", "mlp", "norms", "head", "other")


def param_parts(model: nn.Module) -> dict[int, tuple[str, bool]]:
    """``id(parameter) -> (part, inside_layers)`` for every parameter (tied ones once)."""
    view = ModelView(model)
    parts: dict[int, tuple[str, bool]] = {}

    def claim(params, part: str, in_layers: bool) -> None:
        for p in params:
            parts.setdefault(id(p), (part, in_layers))

    claim(view.embed_tokens.parameters(), "embeddings", False)
    for layer in view.layers:
        for role in layer.roles:
            claim(layer.linear(role).parameters(), "attention" if role in ("q", "k", "v", "o") else "mlp", True)
        for norm in layer.norms:  # input norms and branch post-norms
            claim(norm.parameters(), "norms", True)
        for norm in (layer.q_norm, layer.k_norm):  # per-head q/k norms (Qwen3)
            if norm is not None:
                claim(norm.parameters(), "norms", True)
        claim(layer.module.parameters(), "other", True)
    if view.final_norm is not None:
        claim(view.final_norm.module.parameters(), "norms", False)
    if view.head is not None:
        claim(view.head.parameters(), "head", False)
    claim(model.parameters(), "other", False)  # position embeddings and anything else outside the layers
    return parts


def params_by_part(model: nn.Module) -> dict[str, int]:
    parts = param_parts(model)
    counts = dict.fromkeys((*PARTS, "layers", "total"), 0)
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        part, in_layers = parts[id(p)]
        counts[part] += p.numel()
        counts["layers"] += p.numel() if in_layers else 0
        counts["total"] += p.numel()
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
    per_token += _residual_matrix_weights(model)
    return (per_token + attention) * seq_len


def _residual_matrix_weights(model: nn.Module) -> int:
    """Weights of SP3's residual / basis-change matrices: each multiplies every token once."""
    from slimkit.primitives.projection.adapters import BasisChange

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, BasisChange))
