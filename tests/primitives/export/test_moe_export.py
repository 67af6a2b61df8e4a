"""Exports of MoE models with removed experts: GGUF (llama.cpp's qwen3moe, and llama with experts for Mixtral)
and plain Hugging Face folders when every layer keeps the same count; one-line refusals otherwise."""

import gguf
import pytest
import torch

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


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_uniform_gguf_logits_match_in_llamacpp(tmp_path, family):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    if family == "qwen3_moe":
        model = _pruned_qwen3_moe()
    else:
        torch.manual_seed(0)
        model = MOE_FAMILIES["mixtral"](vocab_size=270, experts=6)
        for block in moe_blocks(model):
            keep_experts(block, [0, 2, 4, 5])
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert result.architecture == ("qwen3moe" if family == "qwen3_moe" else "llama")
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
    with pytest.raises(SlimkitError, match="GGUF export supports"):
        export(MOE_FAMILIES["olmoe"](), tmp_path / "x.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
