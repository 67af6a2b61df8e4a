"""Tiny model and tokenizer factories for tests (random weights, built offline in milliseconds)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def _randomise_norms(model: torch.nn.Module) -> torch.nn.Module:
    # Norm weights start at 1 (and biases at 0); random values make equality tests meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def tiny_llama(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _randomise_norms(LlamaForCausalLM(config))


# Llama-family widths shared by the tiny Mistral / Qwen2 / Qwen3 (same as tiny_llama: GQA 6/2 heads of 8).
_FAMILY_WIDTHS = dict(
    hidden_size=48,
    intermediate_size=64,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _randomise_attention_biases(model: torch.nn.Module) -> torch.nn.Module:
    # Linear biases start at 0; random q/k/v biases make bias bookkeeping visible in equality tests.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
                param.copy_(torch.randn_like(param) * 0.5)
    return model


def tiny_mistral(
    vocab_size: int = 300, layers: int = 3, tie: bool = False, sliding_window: int | None = 4096
) -> MistralForCausalLM:
    """Mistral with GQA; the sliding window (Mistral's default 4096) is longer than any test input
    unless a short one is given."""
    config = MistralConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        sliding_window=sliding_window,
        **_FAMILY_WIDTHS,
    )
    return _randomise_norms(MistralForCausalLM(config))


def tiny_qwen2(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> Qwen2ForCausalLM:
    """Qwen2 with GQA and biased q/k/v projections (Qwen2 always has them; random, non-zero here).

    Like real Qwen2 configs, no ``head_dim`` field: the attention derives it as hidden_size / heads (8).
    """
    widths = {k: v for k, v in _FAMILY_WIDTHS.items() if k != "head_dim"}
    config = Qwen2Config(vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, **widths)
    return _randomise_norms(_randomise_attention_biases(Qwen2ForCausalLM(config)))


def tiny_qwen3(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> Qwen3ForCausalLM:
    """Qwen3 with GQA and per-head q/k RMSNorms (``q_norm``/``k_norm`` over head_dim, random weights).

    As in real Qwen3 models, heads x head_dim (6 x 12 = 72) differs from hidden_size (48).
    """
    widths = {**_FAMILY_WIDTHS, "head_dim": 12}
    config = Qwen3Config(vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, **widths)
    return _randomise_norms(Qwen3ForCausalLM(config))


FAMILIES = {"llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}
"""Llama-family factories by model_type (each ``factory(vocab_size=..., layers=...)``)."""


def _widths(**overrides: object) -> dict:
    return {**_FAMILY_WIDTHS, **overrides}


def tiny_gemma(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Gemma: RMSNorms scaled by (1 + w) (random w here), embeddings multiplied by sqrt(hidden_size)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, **_widths())
    return _randomise_norms(GemmaForCausalLM(config))


def _gemma_windows(layers: int) -> list[str]:
    # Gemma 2 alternates sliding and full attention; Gemma 3 has five sliding layers per full one. A window of 4
    # tokens is shorter than the test inputs, so the sliding layers differ from full attention.
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


def tiny_gemma2(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Gemma 2: branch post-norms, attention and final soft-capping, sliding-window layers (window 4)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        sliding_window=4,
        layer_types=_gemma_windows(layers),
        query_pre_attn_scalar=8,
        attn_implementation="eager",
        **_widths(),
    )
    return _randomise_norms(Gemma2ForCausalLM(config))


def tiny_gemma3_text(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Gemma 3 text: Gemma 2's layout with per-head q/k norms (over head_dim 12 here, as heads x head_dim differs
    from hidden_size in real ones) and no attention soft-capping; sliding window 4."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        sliding_window=4,
        layer_types=_gemma_windows(layers),
        query_pre_attn_scalar=12,
        **_widths(head_dim=12),
    )
    return _randomise_norms(Gemma3ForCausalLM(config))


def tiny_granite(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Granite: Llama's modules with embedding, attention and residual multipliers and a logits scaling (none 1)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=2.0,
        **_widths(),
    )
    return _randomise_norms(GraniteForCausalLM(config))


def tiny_olmo2(vocab_size: int = 300, layers: int = 3, tie: bool = False) -> torch.nn.Module:
    """OLMo 2: branch post-norms only, q/k RMSNorms over the whole q and k projections."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    widths = {k: v for k, v in _FAMILY_WIDTHS.items() if k != "head_dim"}  # OLMo 2 derives it: 48 / 6 = 8
    config = Olmo2Config(vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, **widths)
    return _randomise_norms(Olmo2ForCausalLM(config))


def tiny_phi3(
    vocab_size: int = 300, layers: int = 3, tie: bool = False, partial_rotary_factor: float = 1.0
) -> torch.nn.Module:
    """Phi-3: fused qkv_proj and gate_up_proj, seen as their parts (slimkit's view, as slimkit.load gives it);
    ``partial_rotary_factor`` < 1 is Phi-4-mini's RoPE over part of each head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from slimkit.primitives.arch.fused import split_fused

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor}
    config = Phi3Config(
        vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, rope_parameters=rope, **_widths()
    )
    return split_fused(_randomise_norms(Phi3ForCausalLM(config)))


def tiny_same_as_llama(model_type: str, vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """A decoder whose modules are Llama's (``SAME_AS_LLAMA`` in primitives/arch/spec.py), from its own config class."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, **_FAMILY_WIDTHS
    )
    return _randomise_norms(AutoModelForCausalLM.from_config(config))


NEW_FAMILIES = {
    "gemma": tiny_gemma,
    "gemma2": tiny_gemma2,
    "gemma3_text": tiny_gemma3_text,
    "granite": tiny_granite,
    "olmo2": tiny_olmo2,
    "phi3": tiny_phi3,
}
"""The decoder families beyond Llama's (each ``factory(vocab_size=..., layers=...)``)."""


def tiny_olmo3(vocab_size: int = 300, layers: int = 3, tie: bool = False) -> torch.nn.Module:
    """OLMo 3: OLMo 2's modules with sliding-window layers (window 4, shorter than the test inputs), every fourth layer
    attending to the whole context as in the released models."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    widths = {k: v for k, v in _FAMILY_WIDTHS.items() if k != "head_dim"}  # derived: 48 / 6 = 8
    config = Olmo3Config(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        sliding_window=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)],
        **widths,
    )
    return _randomise_norms(Olmo3ForCausalLM(config))


def tiny_glm4(
    vocab_size: int = 300, layers: int = 3, tie: bool = False, partial_rotary_factor: float = 0.5
) -> torch.nn.Module:
    """GLM-4 (dense): fused gate_up_proj (seen as its parts), q/k/v biases, four norms a layer, RoPE over half of
    each head in adjacent pairs."""
    from transformers import Glm4Config, Glm4ForCausalLM

    from slimkit.primitives.arch.fused import split_fused

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor}
    config = Glm4Config(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        rope_parameters=rope,
        attention_bias=True,
        **_widths(),
    )
    return split_fused(_randomise_norms(_randomise_attention_biases(Glm4ForCausalLM(config))))


DENSE_2026 = {"olmo3": tiny_olmo3, "glm4": tiny_glm4}
"""Dense decoder families added as architecture data only (each ``factory(vocab_size=..., layers=...)``)."""


def tiny_gemma3_vlm(vocab_size: int = 300, layers: int = 2) -> torch.nn.Module:
    """Gemma 3 as a vision-language model (``Gemma3ForConditionalGeneration``): the tiny Gemma 3 text model (one
    sliding, one full layer), a one-layer SigLIP vision tower on 28 x 28 images of 7 x 7 patches and the projector
    pooling them to 4 image tokens. The last three ids are the image's begin, end and placeholder tokens
    (:func:`gemma3_vlm_inputs`); the projector's matrix starts at zero and is random here, so the image matters."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        sliding_window=4,
        layer_types=_gemma_windows(layers),
        query_pre_attn_scalar=12,
        **_widths(head_dim=12),
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=vocab_size - 3,
        eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
        architectures=["Gemma3ForConditionalGeneration"],
    )
    model = _randomise_norms(Gemma3ForConditionalGeneration(config))
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    return model


def gemma3_vlm_inputs(vocab_size: int, prompt: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids`` (begin-of-image, 4 placeholders, end-of-image, then ``prompt``), ``token_type_ids`` (1 on the
    placeholders) and ``pixel_values`` of one random 28 x 28 image, for :func:`tiny_gemma3_vlm`."""
    image = vocab_size - 1
    ids = torch.tensor([[vocab_size - 3, *[image] * 4, vocab_size - 2, *prompt]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "token_type_ids": (ids == image).long(), "pixel_values": pixels}


def tiny_opt(vocab_size: int = 300, layers: int = 2) -> OPTForCausalLM:
    config = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return _randomise_norms(OPTForCausalLM(config))


DECODERS = {**FAMILIES, **NEW_FAMILIES, **DENSE_2026, "opt": tiny_opt}
"""Every dense decoder family with its own tiny factory, for the architecture x recipe matrix."""


def tiny_bert(vocab_size: int = 300, layers: int = 2) -> BertModel:
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    return _randomise_norms(BertModel(config))


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + specials), no training, no files."""
    byte_vocab = {ch: i + 3 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **byte_vocab}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def model_output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One no-grad forward: the logits, or an encoder's last hidden state."""
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal within ``tol`` times the larger of 1 and ``expected``'s largest magnitude (no relative term)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol * max(scale, 1.0))


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The byte tokenizer plus three BPE merges (``Ġ t``, ``h e``, ``Ġt he``): GGUF's gpt2 tokenizer needs merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_vocab = {ch: i + 3 for i, ch in enumerate(sorted(alphabet))}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **byte_vocab}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def spm_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE tokenizer (Llama 2 / Mistral 7B shape): byte fallback, ``▁`` for spaces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "t", "h", "e", "▁t", "he", "▁the"):
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# -- mixture-of-experts decoders (fused expert tensors; attention as their dense relatives) --------------------------
_MOE_WIDTHS = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _randomise_routers(model: torch.nn.Module) -> torch.nn.Module:
    # Qwen's and OLMoE's routers start at zero (every expert ties); random rows make routing meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                param.copy_(torch.randn_like(param) * 0.5)
    return model


def tiny_mixtral(vocab_size: int = 300, layers: int = 2, experts: int = 6, top_k: int = 2, tie: bool = False):
    """Mixtral: ``num_local_experts`` experts of width ``intermediate_size``, top-k renormalised always."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=24,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        head_dim=8,
        tie_word_embeddings=tie,
        **_MOE_WIDTHS,
    )
    return _randomise_norms(_randomise_routers(MixtralForCausalLM(config)))


def tiny_qwen2_moe(vocab_size: int = 300, layers: int = 2, experts: int = 6, top_k: int = 2, tie: bool = False):
    """Qwen2-MoE: ``num_experts`` routed experts of ``moe_intermediate_size``, a shared expert with a sigmoid gate,
    top-k weights not renormalised (``norm_topk_prob`` false, as in Qwen1.5-MoE)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,
        tie_word_embeddings=tie,
        **_MOE_WIDTHS,
    )
    return _randomise_norms(_randomise_attention_biases(_randomise_routers(Qwen2MoeForCausalLM(config))))


def tiny_qwen3_moe(vocab_size: int = 300, layers: int = 2, experts: int = 8, top_k: int = 2, tie: bool = False):
    """Qwen3-MoE: ``num_experts`` experts of ``moe_intermediate_size``, renormalised top-k, per-head q/k norms."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        head_dim=8,
        tie_word_embeddings=tie,
        **_MOE_WIDTHS,
    )
    return _randomise_norms(_randomise_routers(Qwen3MoeForCausalLM(config)))


def tiny_olmoe(
    vocab_size: int = 300, layers: int = 2, experts: int = 6, top_k: int = 2, tie: bool = False, kv_heads: int = 2
):
    """OLMoE: ``num_experts`` experts of width ``intermediate_size``, q/k norms over the whole projection
    (``kv_heads`` 4: no grouped keys, as the released OLMoE)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,
        tie_word_embeddings=tie,
        **{**_MOE_WIDTHS, "num_key_value_heads": kv_heads},
    )
    return _randomise_norms(_randomise_routers(OlmoeForCausalLM(config)))


def _randomise_moe_2026(model: torch.nn.Module, std: float = 0.5) -> torch.nn.Module:
    # Routers, router biases and choice corrections, expert biases and attention sinks start at zero (or ones):
    # random values make routing and every sliced vector visible in equality tests.
    suffixes = (
        "mlp.gate.weight",
        "mlp.router.weight",
        "feed_forward.router.weight",
        "router.bias",
        "e_score_correction_bias",
        "gate_up_proj_bias",
        "down_proj_bias",
        "self_attn.sinks",
    )
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(suffixes):
                tensor.copy_(torch.randn_like(tensor) * (0.1 if name.endswith("correction_bias") else std))
    return model


def tiny_deepseek_v3(
    vocab_size: int = 300, layers: int = 3, experts: int = 8, top_k: int = 2, tie: bool = False, groups: int = 2
):
    """DeepSeek-V3 / Kimi K2: multi-head latent attention (query rank 24, key-value rank 16, heads of 8 + 4 rotary
    dimensions, values of 8), one dense first layer, ``experts`` routed experts in ``groups`` groups (one picked per
    token; DeepSeek-V3 has 8, Kimi K2 1) beside two shared experts (one MLP of twice the width), sigmoid routing with
    a correction bias and a scaling factor."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=experts,
        n_shared_experts=2,
        n_group=groups,
        topk_group=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _randomise_norms(_randomise_moe_2026(DeepseekV3ForCausalLM(config)))


def tiny_glm4_moe(
    vocab_size: int = 300, layers: int = 3, experts: int = 8, top_k: int = 2, tie: bool = False, groups: int = 2
):
    """GLM-4.5: per-head q/k norms, RoPE over half of each head, one dense first layer, ``experts`` routed experts
    in ``groups`` groups (GLM-4.5 has 1) beside two shared experts (DeepSeek-V3's router)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=128,
        moe_intermediate_size=16,
        head_dim=8,
        n_routed_experts=experts,
        n_shared_experts=2,
        n_group=groups,
        topk_group=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=tie,
        **_MOE_WIDTHS,
    )
    return _randomise_norms(_randomise_moe_2026(Glm4MoeForCausalLM(config)))


def tiny_gpt_oss(vocab_size: int = 300, layers: int = 2, experts: int = 8, top_k: int = 2, tie: bool = False):
    """GPT-OSS: biased attention with a learned sink per query head (8 heads over 2 KV heads), sliding (window 4) and
    full layers alternating, ``experts`` experts with biases and the interleaved, clamped gate/up (limit 1.0, reached
    by these weights)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=16,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=4,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        swiglu_limit=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie,
        **{**_MOE_WIDTHS, "num_attention_heads": 8},
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0.0, 0.3)
    return _randomise_norms(_randomise_attention_biases(_randomise_moe_2026(model)))


def tiny_llama4_text(vocab_size: int = 300, layers: int = 4, experts: int = 4, top_k: int = 1, tie: bool = False):
    """Llama 4 (text): dense and routed layers interleaved (layers 1 and 3 route, with a shared expert), top-1
    routing scaling each expert's input, no RoPE in every 4th layer, chunked attention (4 tokens), L2 q/k norms."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=16,
        intermediate_size_mlp=48,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        interleave_moe_layer_step=2,
        attention_chunk_size=4,
        floor_scale=4,
        tie_word_embeddings=tie,
        **_MOE_WIDTHS,
    )
    return _randomise_norms(_randomise_moe_2026(Llama4ForCausalLM(config)))


MOE_2026 = {
    "deepseek_v3": tiny_deepseek_v3,
    "glm4_moe": tiny_glm4_moe,
    "gpt_oss": tiny_gpt_oss,
    "llama4_text": tiny_llama4_text,
}
"""The mixture-of-experts families added since (each ``factory(vocab_size=..., layers=..., experts=..., top_k=...)``);
not in :data:`MOE_FAMILIES`, whose tests assume every layer routes by a softmax."""


MOE_FAMILIES = {
    "mixtral": tiny_mixtral,
    "qwen2_moe": tiny_qwen2_moe,
    "qwen3_moe": tiny_qwen3_moe,
    "olmoe": tiny_olmoe,
}
"""Mixture-of-experts factories by model_type (each ``factory(vocab_size=..., layers=..., experts=..., top_k=...)``)."""


GLUE_CALIBRATION = {"dataset": "glue", "samples": 4, "seq_len": 32, "batch_size": 2, "examples": 32}
"""GLUE calibration small enough for the tiny BERT."""


def shrink_encoder_recipe(raw: dict, model_dir) -> dict:
    """A copy of an encoder (GLUE) recipe for the tiny BERT in ``model_dir``: GLUE calibration and a few steps of
    every training stage (the caller sets ``eval`` and the target's strictness)."""
    import copy

    raw = copy.deepcopy(raw)
    raw["model"] = str(model_dir)
    if "calibration" in raw:
        raw["calibration"] = dict(GLUE_CALIBRATION)
    for stage in raw["stages"]:
        args = stage.get("args") or {}
        stage["args"] = args
        if stage["stage"] == "glue_finetune":
            args.update(max_steps=2, batch_size=8, max_length=32)
        elif stage["stage"] == "pca_project_post":
            args.update(tokens=None)
        elif stage["stage"] == "mask_train_encoder":
            args.update(
                finetune_steps=1,
                dimension_steps=2,
                joint_steps=2,
                warmup_steps=1,
                batch_size=4,
                max_length=32,
                check_examples=16,
            )
    return raw


# -- hybrids: decoder layers of several kinds (gated DeltaNet or Mamba-2 beside attention) --------------------------
def _alternating(layers: int, pattern: tuple[str, ...]) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(layers)]


def _randomise_mixers(model: torch.nn.Module) -> torch.nn.Module:
    # Mamba-2's D starts at 1 and dt_bias at 1; random values make the per-head bookkeeping visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".D", ".dt_bias")):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.endswith("conv1d.bias"):
                param.copy_(torch.randn_like(param) * 0.2)
    return model


def tiny_qwen3_5_text(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Qwen 3.5 (text): gated DeltaNet layers (2 key heads, 6 value heads of 8) alternating with gated attention
    (6/2 heads of 8, query and output gate per head, RoPE over a quarter of each head), (1 + w) RMSNorms."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        layer_types=_alternating(layers, ("linear_attention", "full_attention")),
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        **_FAMILY_WIDTHS,
    )
    return _randomise_norms(Qwen3_5ForCausalLM(config))


def tiny_nemotron_h(vocab_size: int = 300, layers: int = 3, tie: bool = False) -> torch.nn.Module:
    """Nemotron-H: one block per layer, Mamba-2 (8 heads of 6 in 2 SSM groups, state 8), attention (6/2 heads of 8)
    or a plain relu^2 MLP, each under one RMSNorm; chunks of 4 tokens so the scan crosses chunks."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    widths = {k: v for k, v in _FAMILY_WIDTHS.items() if k != "max_position_embeddings"}
    config = NemotronHConfig(
        vocab_size=vocab_size,
        layers_block_type=_alternating(layers, ("linear_attention", "mlp", "full_attention", "mlp")),
        tie_word_embeddings=tie,
        mamba_num_heads=8,
        mamba_head_dim=6,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=4,
        layer_norm_epsilon=1e-6,
        **widths,
    )
    return _randomise_mixers(_randomise_norms(NemotronHForCausalLM(config)))


def tiny_granitemoehybrid(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> torch.nn.Module:
    """Granite 4.0-H (dense, as H-Micro): Mamba-2 (8 heads of 12 = 2 x hidden, 2 SSM groups) alternating with
    attention (no position embeddings), each followed by a fused gated shared MLP; Granite's multipliers (none 1)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    widths = {k: v for k, v in _FAMILY_WIDTHS.items() if k != "head_dim"}  # intermediate_size: the experts' (none)
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        tie_word_embeddings=tie,
        layer_types=_alternating(layers, ("linear_attention", "full_attention")),
        num_local_experts=0,
        shared_intermediate_size=64,
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_chunk_size=4,
        embedding_multiplier=3.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=2.0,
        **widths,
    )
    from slimkit.primitives.arch.fused import split_fused

    return split_fused(_randomise_mixers(_randomise_norms(GraniteMoeHybridForCausalLM(config))))


HYBRID_FAMILIES = {
    "qwen3_5_text": tiny_qwen3_5_text,
    "nemotron_h": tiny_nemotron_h,
    "granitemoehybrid": tiny_granitemoehybrid,
}
"""Dense hybrids by model_type (each ``factory(vocab_size=..., layers=...)``)."""


def _hybrid_moe_widths(layers: int, experts: int, top_k: int) -> dict:
    return dict(
        num_hidden_layers=layers,
        layer_types=_alternating(layers, ("linear_attention", "full_attention")),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=experts,
        num_experts_per_tok=top_k,
        head_dim=8,
        **_MOE_WIDTHS,
    )


def tiny_qwen3_5_moe_text(vocab_size: int = 300, layers: int = 2, experts: int = 6, top_k: int = 2, tie: bool = False):
    """Qwen 3.5 MoE (text): Qwen 3.5's layers (gated DeltaNet of 2 key / 4 value heads, gated attention 4/2 heads)
    with routed experts of ``moe_intermediate_size`` (top-k always renormalised) beside a gated shared expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, tie_word_embeddings=tie, **_hybrid_moe_widths(layers, experts, top_k)
    )
    return _randomise_norms(_randomise_routers(Qwen3_5MoeForCausalLM(config)))


def tiny_qwen3_next(vocab_size: int = 300, layers: int = 2, experts: int = 6, top_k: int = 2, tie: bool = False):
    """Qwen3-Next: Qwen 3.5 MoE's layout with q/k/v/z and b/a fused per key head, top-k renormalised."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=tie,
        norm_topk_prob=True,
        intermediate_size=40,
        **_hybrid_moe_widths(layers, experts, top_k),
    )
    return _randomise_norms(_randomise_routers(Qwen3NextForCausalLM(config)))


HYBRID_MOE_FAMILIES = {"qwen3_5_moe_text": tiny_qwen3_5_moe_text, "qwen3_next": tiny_qwen3_next}
"""Hybrids whose MLP is routed experts (each ``factory(vocab_size=..., layers=..., experts=..., top_k=...)``)."""
