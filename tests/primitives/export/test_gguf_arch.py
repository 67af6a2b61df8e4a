"""The decoder families added as data, written as llama.cpp's architectures (OLMo 3 as olmo2, GLM-4 as glm4): the
files' logits equal PyTorch's in llama.cpp (SiLU: no table, a float32 cache), per-layer widths padded exactly, and
what llama.cpp would compute otherwise refused in one line before anything is written. The MoE families added since
export as plain Hugging Face folders; their GGUF layouts are refused in one line."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.llamacpp import gguf_logits
from slimkit.primitives.experts import keep_experts
from slimkit.primitives.export import export
from slimkit.primitives.surgery import prune_layer
from tests.tiny import MOE_2026, bpe_tokenizer, model_output, tiny_glm4, tiny_olmo3

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")

IDS = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
EXACT = 1e-5


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


def _diff(model, path) -> float:
    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(path, IDS, threads=2, f32_cache=True))
    return float((actual - expected).abs().max()) / max(1.0, float(expected.abs().max()))


def _olmo3(bpe, layers: int = 4):
    """A tiny OLMo 3 with llama.cpp's pattern (every 4th layer full attention) and a 4-token window."""
    model = tiny_olmo3(vocab_size=len(bpe), layers=layers)
    types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    model.config.layer_types = types
    for layer, kind in zip(model.model.layers, types, strict=True):
        layer.self_attn.attention_type = kind
        layer.self_attn.sliding_window = 4 if kind == "sliding_attention" else None
    return model


def _prune(model, heads: bool) -> None:
    for layer in ModelView(model).layers:
        prune_layer(model, "mlp_channel", layer.index, torch.arange(layer.mlp_width - 8 * (layer.index % 3)))
    if heads:
        prune_layer(model, "kv_group", 1, torch.tensor([0]))
        prune_layer(model, "attention_head", 2, torch.tensor([0, 1, 3, 4]))


@pytest.mark.parametrize("family", ["olmo3", "glm4"])
@pytest.mark.parametrize("pruned", [False, True])
def test_ggufs_equal_pytorch_in_llamacpp(tmp_path, bpe, family, pruned):
    model = _olmo3(bpe) if family == "olmo3" else tiny_glm4(vocab_size=len(bpe), layers=4)
    if pruned:
        _prune(model, heads=family == "glm4")  # OLMo 3's q/k norms span the projection: heads stay
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == {"olmo3": "olmo2", "glm4": "glm4"}[family]
    assert any("padded with zeros" in w for w in result.warnings) == pruned
    assert _diff(model, tmp_path / "m.gguf") <= EXACT


def test_the_window_and_the_partial_rotation_are_in_the_files(tmp_path, bpe):
    """A model without OLMo 3's window, or GLM-4 rotating every dimension, gives other logits from the same file."""
    model = _olmo3(bpe)
    export(model, tmp_path / "o.gguf", "gguf", "f32", tokenizer=bpe)
    model.config.sliding_window = 64  # longer than the inputs: every layer attends to all of them
    assert _diff(model, tmp_path / "o.gguf") > 100 * EXACT
    model = tiny_glm4(vocab_size=len(bpe), layers=2)
    export(model, tmp_path / "g.gguf", "gguf", "f32", tokenizer=bpe)
    full = tiny_glm4(vocab_size=len(bpe), layers=2, partial_rotary_factor=1.0)
    full.load_state_dict(model.state_dict())
    assert _diff(full, tmp_path / "g.gguf") > 100 * EXACT


def test_what_llamacpp_would_compute_otherwise_is_refused(tmp_path, bpe):
    model = tiny_olmo3(vocab_size=len(bpe), layers=4)
    model.config.layer_types = ["sliding_attention", "full_attention"] * 2  # alternating: not llama.cpp's pattern
    with pytest.raises(SlimkitError, match=r"^layer_types: llama.cpp's olmo2 \(which runs OLMo 3\) makes every 4th"):
        export(model, tmp_path / "a.gguf", "gguf", "f32", tokenizer=bpe)
    model = _olmo3(bpe)
    model.config.rope_parameters["sliding_attention"] = {"rope_type": "default", "rope_theta": 1000.0}
    with pytest.raises(SlimkitError, match=r"^RoPE bases that differ between sliding and full layers"):
        export(model, tmp_path / "b.gguf", "gguf", "f32", tokenizer=bpe)
    model = tiny_glm4(vocab_size=len(bpe), layers=2)
    model.config.mlp_bias = True
    with pytest.raises(SlimkitError, match=r"^mlp_bias: llama.cpp's glm4 reads no such biases"):
        export(model, tmp_path / "c.gguf", "gguf", "f32", tokenizer=bpe)
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("family", ["olmo3", "glm4"])
def test_uniform_widths_export_as_a_plain_hugging_face_folder(tmp_path, bpe, family):
    model = tiny_olmo3(vocab_size=len(bpe)) if family == "olmo3" else tiny_glm4(vocab_size=len(bpe))
    for layer in ModelView(model).layers:
        prune_layer(model, "mlp_channel", layer.index, torch.arange(48))
    result = export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-4


@pytest.mark.parametrize("family", sorted(MOE_2026))
def test_moe_families_export_as_plain_folders_and_gguf_or_refuse_in_one_line(tmp_path, bpe, family):
    """The same experts removed in every routed layer (the same count in every router group): stock transformers
    reads the folder (logits checked by the export); GGUF is written for GLM-4.5 (llama.cpp's glm4moe, its router
    groups as llama.cpp's expert groups) and names llama.cpp's architecture in a one-line refusal for the others."""
    model = MOE_2026[family](vocab_size=len(bpe), layers=4)
    for block in moe_blocks(model):
        size = block.num_experts // block.router_groups
        keep_experts(block, [e for e in range(block.num_experts) if e % size != size - 1])
    result = export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-4
    if family == "glm4_moe":
        assert export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe).architecture == "glm4moe"
        assert _diff(model, tmp_path / "m.gguf") <= 1e-5
        return
    with pytest.raises(SlimkitError, match=rf"^GGUF export of {family}: llama.cpp runs it as ") as refused:
        export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert "\n" not in str(refused.value) and not (tmp_path / "m.gguf").exists()
