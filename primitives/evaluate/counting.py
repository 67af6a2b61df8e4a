"""Parameter and MAC counts, overall and per part of the model.

Parts: ``embeddings`` (token/position embeddings), ``attention`` (q, k, v, o; a hybrid's gated DeltaNet and Mamba-2
mixers), ``mlp`` (gate/up/down or fc1/fc2), ``norms``, ``head`` (an untied output head), ``other``. ``layers`` is
attention + mlp + norms inside the decoder/encoder layers. Tied weights count once.

MACs are counted for one forward pass over one sequence of ``seq_len`` tokens: every Linear in
the layers and the head costs in x out per token (in a MoE MLP: the router, the top-k experts a token uses and a
shared expert); attention adds QK^T and AV, ``heads x head_dim
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
        mixer = layer.mixer  # a hybrid's gated DeltaNet or Mamba-2 mixer: the layer's token mixing, as attention is
        if mixer is not None:
            claim(mixer.module.parameters(), "attention", True)
        if layer.spec.experts is not None and layer.spec.mlp is not None and layer.has_mlp:
            claim(layer.module.get_submodule(layer.spec.mlp).parameters(), "mlp", True)  # router, experts, shared
        for norm in layer.norms:  # input norms and branch post-norms
            claim(norm.parameters(), "norms", True)
        for qk_norm in (layer.q_norm, layer.k_norm):  # per-head q/k norms (Qwen3)
            if qk_norm is not None:
                claim(qk_norm.parameters(), "norms", True)
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
    """Every parameter once (tied ones once); needs no architecture adapter."""
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, seq_len: int = 128) -> int:
    view = ModelView(model)
    per_token = 0
    attention = 0
    for layer in view.layers:
        for linear in [*(layer.linear(role) for role in layer.roles), *layer.extra_linears()]:
            per_token += sum(p.numel() for name, p in linear.named_parameters() if name.endswith("weight"))
        mixer = layer.mixer
        for linear in mixer.linears().values() if mixer is not None else ():
            per_token += sum(p.numel() for name, p in linear.named_parameters() if name.endswith("weight"))
        attention += 2 * layer.num_heads * layer.head_dim * seq_len
    if view.head is not None:
        per_token += view.head.weight.numel()
    per_token += _residual_matrix_weights(model)
    per_token += _routed_weights_per_token(model)
    return (per_token + attention) * seq_len


def _routed_weights_per_token(model: nn.Module) -> int:
    """Weights a token multiplies in the MoE MLPs: the router, its top-k experts, and the shared expert with its
    gate (Qwen2-MoE)."""
    from slimkit.primitives.arch.moe import moe_blocks, moe_spec

    if moe_spec(model) is None:
        return 0
    total = 0
    for block in moe_blocks(model):
        hidden = int(block.router.weight.shape[1])
        total += block.router.weight.numel() + block.top_k * 3 * hidden * block.width
        if block.shared_expert is not None and block.spec.arch.shared_mlp is None:  # else counted as the MLP roles
            total += sum(p.numel() for p in block.shared_expert.parameters())
            gate = block.spec.shared_expert_gate
            if gate is not None:
                total += block.module.get_submodule(gate.rpartition(".")[2]).weight.numel()
    return total


def _residual_matrix_weights(model: nn.Module) -> int:
    """Weights of SP3's residual / basis-change matrices: each multiplies every token once."""
    from slimkit.primitives.projection.adapters import BasisChange

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, BasisChange))
