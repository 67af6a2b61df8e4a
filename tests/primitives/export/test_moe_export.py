"""Exports of MoE models with removed experts: GGUF (llama.cpp's qwen3moe, qwen2moe with its shared expert, olmoe,
llama with experts for Mixtral, glm4moe for GLM-4.5) and plain Hugging Face folders when every layer keeps the same
count; one-line refusals otherwise."""

import gguf
import pytest
import torch
from torch import nn

from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts import keep_experts
from slimkit.primitives.export import export
from slimkit.primitives.export.gguf_file import split_experts
from tests.tiny import MOE_FAMILIES, bpe_tokenizer, model_output, tiny_qwen3_moe

IDS = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def _pruned_qwen3_moe(uniform: bool = True):
    torch.manual_seed(0)
    model = tiny_qwen3_moe(vocab_size=270)
    first, second = moe_blocks(model)
    keep_experts(first, [0, 2, 4, 5, 7])
    keep_experts(second, [1, 2, 3, 6, 7] if uniform else [1, 2, 3])
    return model


def test_split_experts_by_hand():
    fused = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    out = split_experts({"model.layers.0.mlp.experts.gate_up_proj": fused, "x": torch.zeros(1)})
    assert torch.equal(out["model.layers.0.mlp.experts.gate_proj"], fused[:, :2])
    assert torch.equal(out["model.layers.0.mlp.experts.up_proj"], fused[:, 2:])
    assert list(out) == ["model.layers.0.mlp.experts.gate_proj", "model.layers.0.mlp.experts.up_proj", "x"]


def test_uniform_qwen3_moe_gguf_holds_the_kept_experts(tmp_path):
    model = _pruned_qwen3_moe()
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert result.architecture == "qwen3moe"
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == [32, 16, 5]  # ggml order: hidden, width, experts
    assert shapes["blk.0.ffn_down_exps.weight"] == [16, 32, 5]
    assert shapes["blk.1.ffn_gate_inp.weight"] == [32, 5]
    assert reader.fields["qwen3moe.expert_count"].contents() == 5
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen3_moe", {}),
        ("mixtral", {}),
        ("qwen2_moe", {}),
        ("qwen2_moe", {"tie": True}),  # llama.cpp's qwen2moe reads a head tensor: the embedding is written again
        ("olmoe", {"kv_heads": 4}),
    ],
)
def test_uniform_gguf_logits_match_in_llamacpp(tmp_path, family, options):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    if family == "qwen3_moe":
        model = _pruned_qwen3_moe()
    else:
        torch.manual_seed(0)
        model = MOE_FAMILIES[family](vocab_size=270, experts=6, **options)
        for block in moe_blocks(model):
            keep_experts(block, [0, 2, 4, 5])
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert result.architecture == GGUF_ARCH[family]
    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", IDS, threads=1))
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) <= 1e-3 * max(float(expected.abs().max()), 1.0)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_uniform_counts_export_as_a_plain_hf_folder(tmp_path, family):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259, experts=6)
    for block in moe_blocks(model):
        keep_experts(block, [0, 1, 3, 5])
    result = export(model, tmp_path / "hf", "hf", tokenizer=bpe_tokenizer())
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff <= 1e-4


def test_per_layer_counts_and_unrenormalised_routing_are_refused_in_one_line(tmp_path):
    model = _pruned_qwen3_moe(uniform=False)
    with pytest.raises(SlimkitError, match=r"llama\.cpp reads one expert count"):
        export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    with pytest.raises(SlimkitError, match=r"neither a Hugging Face config nor llama\.cpp"):
        export(model, tmp_path / "hf", "hf", tokenizer=bpe_tokenizer())
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "hf").exists()
    plain = tiny_qwen3_moe(vocab_size=270)
    plain.config.norm_topk_prob = False
    with pytest.raises(SlimkitError, match="always renormalises"):
        export(plain, tmp_path / "n.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())


def test_the_qwen2moe_gguf_holds_the_shared_expert(tmp_path):
    torch.manual_seed(0)
    model = MOE_FAMILIES["qwen2_moe"](vocab_size=270, experts=6)
    for block in moe_blocks(model):
        keep_experts(block, [0, 2, 4, 5])
    export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == [32, 16, 4]
    assert shapes["blk.0.ffn_gate_shexp.weight"] == [32, 24] and shapes["blk.0.ffn_down_shexp.weight"] == [24, 32]
    assert shapes["blk.1.ffn_gate_inp_shexp.weight"] == [32]  # Linear(hidden, 1) as the vector llama.cpp reads
    assert shapes["blk.0.attn_q.bias"] == [32]
    assert reader.fields["qwen2moe.expert_shared_feed_forward_length"].contents() == 24
    assert reader.fields["qwen2moe.expert_feed_forward_length"].contents() == 16


def test_what_llamacpps_qwen2moe_and_olmoe_cannot_run_is_refused_in_one_line(tmp_path):
    """Renormalised routing (llama.cpp never renormalises there), grouped keys in OLMoE (its key norm spans the
    hidden size), removed attention heads (the query spans the hidden size), shared experts of several widths,
    clipped q/k/v: one line each, nothing written."""
    from slimkit.primitives.surgery import prune_layer

    cases = []
    renormalised = MOE_FAMILIES["qwen2_moe"](vocab_size=270)
    renormalised.config.norm_topk_prob = True
    cases.append((renormalised, "norm_topk_prob true: llama.cpp's qwen2moe never renormalises"))
    cases.append((MOE_FAMILIES["olmoe"](vocab_size=270), "key width 16 is not the hidden size 32"))
    headless = MOE_FAMILIES["qwen2_moe"](vocab_size=270)
    for index in range(2):
        prune_layer(headless, "kv_group", index, torch.tensor([1]))  # one of two key groups: 2 of 4 query heads
    cases.append((headless, "query width 16 is not the hidden size 32"))
    uneven = MOE_FAMILIES["qwen2_moe"](vocab_size=270)
    shared = uneven.model.layers[0].mlp.shared_expert  # a narrower shared expert in layer 0 only
    shared.gate_proj, shared.up_proj, shared.down_proj = nn.Linear(32, 12), nn.Linear(32, 12), nn.Linear(12, 32)
    cases.append((uneven, r"shared expert widths \[12, 24\] differ"))
    clipped = MOE_FAMILIES["olmoe"](vocab_size=270, kv_heads=4)
    clipped.config.clip_qkv = 8.0
    cases.append((clipped, "clip_qkv 8.0"))
    for model, fragment in cases:
        with pytest.raises(SlimkitError, match=fragment) as error:
            export(model, tmp_path / "x.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
        assert "\n" not in str(error.value)
        assert not (tmp_path / "x.gguf").exists()


def test_export_verdicts_apply_llamacpps_query_and_key_widths():
    """``slimkit inspect``'s verdict reads the same rule as the exporter (query_width_refusal), from config.json."""
    from slimkit.primitives.export.gguf_file import query_width_refusal
    from slimkit.primitives.export.plan import export_verdicts

    full = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}
    assert query_width_refusal([full], 32, "olmoe") is None
    assert "key width 16" in (query_width_refusal([{**full, "num_key_value_heads": 2}], 32, "olmoe") or "")
    assert query_width_refusal([{**full, "num_key_value_heads": 2}], 32, "qwen2moe") is None  # GQA is fine there
    assert "query width 24" in (query_width_refusal([full, {**full, "num_attention_heads": 3}], 32, "qwen2moe") or "")
    assert query_width_refusal([{**full, "num_attention_heads": 3}], 32, "qwen3moe") is None  # sized by its heads
    gguf_ok, _ = export_verdicts("olmoe", None, None, {"hidden_size": 32, **full})
    assert (gguf_ok.format, gguf_ok.ok) == ("gguf olmoe", True)
    grouped, _ = export_verdicts("olmoe", None, None, {"hidden_size": 32, **full, "num_key_value_heads": 2})
    assert not grouped.ok and "normalises keys over the hidden size" in grouped.detail


def _glm4_moe(groups: int = 1, prune: bool = False):
    from tests.tiny import tiny_glm4_moe

    torch.manual_seed(0)
    model = tiny_glm4_moe(vocab_size=270, groups=groups)
    if prune:
        for block in moe_blocks(model):
            keep_experts(block, [0, 2, 4, 5])
    return model


@pytest.mark.parametrize(("groups", "prune"), [(1, False), (1, True), (2, True)])
def test_glm4_moe_gguf_logits_match_in_llamacpp(tmp_path, groups, prune):
    """GLM-4.5 as llama.cpp's glm4moe: a dense first layer, sigmoid routing with the choice bias, shared experts,
    q/k norms and RoPE over half of each head; with experts removed, and with group-limited routing (2 groups, 1
    picked) written as llama.cpp's expert groups."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    model = _glm4_moe(groups, prune)
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert result.architecture == "glm4moe"
    assert any("multi-token-prediction layer is not written" in warning for warning in result.warnings)
    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", IDS, threads=1))
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) <= 1e-3 * max(float(expected.abs().max()), 1.0)
    exact = torch.tensor(gguf_logits(tmp_path / "m.gguf", IDS, threads=1, f32_cache=True))
    assert float((exact - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)


def test_the_glm4moe_gguf_holds_llamacpps_names_and_keys(tmp_path):
    export(_glm4_moe(groups=2, prune=True), tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    assert shapes["blk.0.ffn_gate.weight"] == [32, 128] and "blk.0.ffn_gate_inp.weight" not in shapes  # dense
    assert shapes["blk.0.post_attention_norm.weight"] == [32] and shapes["blk.0.attn_q_norm.weight"] == [8]
    assert shapes["blk.1.ffn_gate_exps.weight"] == [32, 16, 4] and shapes["blk.1.ffn_down_exps.weight"] == [16, 32, 4]
    assert shapes["blk.1.ffn_gate_inp.weight"] == [32, 4] and shapes["blk.1.exp_probs_b.bias"] == [4]
    assert shapes["blk.2.ffn_up_shexp.weight"] == [32, 32]  # two shared experts of the expert width 16
    keys = {name.removeprefix("glm4moe."): field.contents() for name, field in reader.fields.items()}
    assert keys["block_count"] == 3 and keys["nextn_predict_layers"] == 0  # no MTP layer in the model
    assert (keys["expert_count"], keys["expert_used_count"], keys["expert_feed_forward_length"]) == (4, 2, 16)
    assert (keys["expert_shared_count"], keys["leading_dense_block_count"], keys["feed_forward_length"]) == (2, 1, 128)
    assert keys["expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    assert (keys["expert_weights_scale"], keys["expert_weights_norm"]) == (1.5, True)
    assert (keys["expert_group_count"], keys["expert_group_used_count"]) == (2, 1)
    assert keys["rope.dimension_count"] == 4  # partial_rotary_factor 0.5 of head_dim 8


def _with_shared_widths(model, widths: list[int]):
    """Layer i + 1's shared experts cut to their first ``widths[i]`` channels, or extended by random ones."""
    torch.manual_seed(1)
    for layer, width in zip(model.model.layers[1:], widths, strict=True):
        shared = layer.mlp.shared_experts
        for role in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(shared, role).weight.detach()
            old = old if role != "down_proj" else old.T  # channels as rows
            grown = torch.randn(width, old.shape[1]) * 0.2
            kept = min(width, old.shape[0])
            grown[:kept] = old[:kept]
            linear = nn.Linear(32, width, bias=False) if role != "down_proj" else nn.Linear(width, 32, bias=False)
            linear.weight.data = grown if role != "down_proj" else grown.T.contiguous()
            setattr(shared, role, linear)
    return model


def test_glm4moe_shared_experts_of_other_widths_are_padded_exactly(tmp_path):
    """llama.cpp's glm4moe builds the shared experts as expert_shared_count experts of the routed width: widths 24 and
    40 (expert width 16) are padded with zero channels to 48, written as 3 shared experts; the logits still match."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    model = _with_shared_widths(_glm4_moe(), [24, 40])
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert any("padded with zero channels to 48" in warning for warning in result.warnings)
    assert result.added_params == (24 + 8) * 3 * 32
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["glm4moe.expert_shared_count"].contents() == 3
    assert {t.name: t.shape.tolist() for t in reader.tensors}["blk.1.ffn_down_shexp.weight"] == [48, 32]
    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", IDS, threads=1, f32_cache=True))
    assert float((actual - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)


def test_glm4moe_expert_counts_that_differ_per_layer_are_refused_in_one_line(tmp_path):
    uneven = _glm4_moe()
    keep_experts(moe_blocks(uneven)[0], [0, 1, 2, 3])
    with pytest.raises(SlimkitError, match="routed experts of shapes") as error:
        export(uneven, tmp_path / "x.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert "\n" not in str(error.value)
    assert not (tmp_path / "x.gguf").exists()
