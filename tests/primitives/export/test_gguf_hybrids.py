"""GGUF files of the Mamba-2 hybrids checked against llama.cpp's logits on tiny models; what llama.cpp cannot run
from them, and the gated DeltaNet hybrids, refused in one line."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import export
from slimkit.primitives.export.gguf_hybrid import pad_feed_forwards
from slimkit.primitives.surgery import prune_layer
from tests.tiny import HYBRID_FAMILIES, HYBRID_MOE_FAMILIES, bpe_tokenizer, model_output

IDS = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()


def _pruned(family: str, mamba: bool = True):
    """MLP channels of a different width in every layer, one query head of three in each KV group and (with
    ``mamba``) half of the Mamba heads of every Mamba layer."""
    torch.manual_seed(0)
    model = HYBRID_FAMILIES[family](vocab_size=len(bpe_tokenizer()), layers=4)
    for layer in ModelView(model).layers:
        if "down" in layer.roles:
            prune_layer(model, "mlp_channel", layer.index, torch.arange(40 - 4 * layer.index))
        if layer.has_attention:
            prune_layer(model, "attention_head", layer.index, torch.tensor([0, 2, 3, 5]))
        if layer.mixer is not None and mamba:
            prune_layer(model, "mamba_head", layer.index, torch.tensor([0, 1, 4, 5]))
    return model


def _close_in_llamacpp(model, path) -> None:
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(path, IDS, threads=1))
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) <= 1e-3 * max(float(expected.abs().max()), 1.0)


@pytest.mark.parametrize(
    ("family", "architecture", "mamba"),
    [
        ("nemotron_h", "nemotron_h", True),
        ("nemotron_h", "nemotron_h", False),  # the gated norm as wide as the hidden size: found by its name
        ("granitemoehybrid", "granitehybrid", False),
    ],
)
def test_pruned_mamba_hybrids_match_llamacpp(tmp_path, family, architecture, mamba):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    model = _pruned(family, mamba=mamba)
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert result.architecture == architecture
    padded = [w for w in result.warnings if w.startswith("MLP widths")]
    assert bool(padded) == (family == "granitemoehybrid")  # nemotron_h reads per-layer widths
    _close_in_llamacpp(model, tmp_path / "m.gguf")


def test_zero_channels_pad_a_gated_mlp_by_hand():
    tensors = {
        "model.layers.0.mlp.gate_proj.weight": torch.ones(2, 3),
        "model.layers.0.mlp.up_proj.weight": torch.ones(2, 3),
        "model.layers.0.mlp.down_proj.weight": torch.ones(3, 2),
    }
    assert pad_feed_forwards(tensors, 4) == 3 * 2 * 3
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (4, 3)
    assert tensors["model.layers.0.mlp.down_proj.weight"][:, 2:].abs().sum() == 0


def test_what_llamacpp_cannot_run_is_refused_in_one_line(tmp_path):
    granite = _pruned("granitemoehybrid")  # Mamba heads removed: llama.cpp's graph needs twice the hidden size
    with pytest.raises(SlimkitError, match=r"^Mamba-2 width 48: llama.cpp's granitehybrid graph requires twice"):
        export(granite, tmp_path / "g.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    nemotron = HYBRID_FAMILIES["nemotron_h"](vocab_size=len(bpe_tokenizer()), layers=8)  # Mamba layers 0 and 4
    prune_layer(nemotron, "mamba_head", 0, torch.tensor([0, 1, 4, 5]))
    with pytest.raises(SlimkitError, match=r"^Mamba-2 widths \(heads x head_dim\) differ between layers \(24, 48\)"):
        export(nemotron, tmp_path / "n.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    for family, factory in {"qwen3_5_text": HYBRID_FAMILIES["qwen3_5_text"], **HYBRID_MOE_FAMILIES}.items():
        with pytest.raises(SlimkitError, match=rf"^GGUF export of {family} is not written by slimkit: llama.cpp's "):
            export(factory(vocab_size=300), tmp_path / f"{family}.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert not list(tmp_path.glob("*.gguf"))
