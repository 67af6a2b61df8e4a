"""Gemma 1-3, Granite and OLMo 2 as llama.cpp's gemma, gemma2, gemma3, granite and olmo2 GGUF: tensor names, the
(1 + w) norms, the window and soft-capping, Granite's multipliers, per-layer widths padded exactly to one width
(llama.cpp does not load per-layer arrays for these architectures), and the refusals where llama.cpp would compute
something else.

llama.cpp caches keys and values in float16 and evaluates GELU from a float16 table; the mapping itself is checked
with a float32 cache and the MLP's output zeroed (then llama.cpp equals PyTorch to float32 rounding), the whole model
with a float32 cache within the GELU table's error.
"""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.blocks import Block, remove_block
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.llamacpp import gguf_logits
from slimkit.primitives.export import export
from slimkit.primitives.export.dense import dense_tensors
from slimkit.primitives.export.gguf_file import phi3_head_refusal, phi3_head_target
from slimkit.primitives.export.padding import pad_to_uniform
from slimkit.primitives.export.plan import export_verdicts
from slimkit.primitives.surgery import prune_layer
from tests.tiny import (
    DECODERS,
    bpe_tokenizer,
    model_output,
    tiny_gemma2,
    tiny_gemma3_text,
    tiny_granite,
    tiny_olmo2,
    tiny_phi3,
    tiny_same_as_llama,
)

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")

IDS = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
GELU_TABLE = 2e-3
"""Max abs logit difference with the MLP (llama.cpp's float16 GELU table), as a fraction of max(1, |logit|)."""
EXACT = 1e-5


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


def _gemma3(bpe, layers: int = 7):
    """A tiny Gemma 3 with llama.cpp's layer pattern (every 6th layer full attention) and a 4-token window."""
    model = tiny_gemma3_text(vocab_size=len(bpe), layers=layers)
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    model.config.layer_types = types
    for layer, kind in zip(model.model.layers, types, strict=True):
        layer.attention_type = kind
        layer.self_attn.sliding_window = 4 if kind == "sliding_attention" else None
        layer.self_attn.is_sliding = kind == "sliding_attention"
    return model


def _diff(model, path) -> float:
    expected = model_output(model, torch.tensor([IDS]))[0].float()
    actual = torch.tensor(gguf_logits(path, IDS, threads=2, f32_cache=True))
    assert actual.shape == expected.shape
    return float((actual - expected).abs().max()) / max(1.0, float(expected.abs().max()))


def _without_mlp_output(model):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
    return model


def _prune(model) -> None:
    for layer in ModelView(model).layers:
        prune_layer(model, "mlp_channel", layer.index, torch.arange(layer.mlp_width - 8 * (layer.index % 3)))
    prune_layer(model, "kv_group", 1, torch.tensor([0]))
    prune_layer(model, "attention_head", 2, torch.tensor([0, 1, 3, 4]))


def _gemma_family(family: str, bpe):
    if family == "gemma3_text":
        return _gemma3(bpe)
    return DECODERS[family](vocab_size=len(bpe), layers=4)  # gemma2: alternating layers, llama.cpp's pattern


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("pruned", [False, True])
def test_gemma_ggufs_equal_pytorch_in_llamacpp(tmp_path, bpe, family, pruned):
    model = _gemma_family(family, bpe)
    if pruned:
        _prune(model)
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == family.removesuffix("_text")
    assert any("padded with zeros" in w for w in result.warnings) == pruned
    assert _diff(model, tmp_path / "m.gguf") <= GELU_TABLE
    _without_mlp_output(model)
    export(model, tmp_path / "x.gguf", "gguf", "f32", tokenizer=bpe)
    assert _diff(model, tmp_path / "x.gguf") <= EXACT  # the mapping itself: names, (1 + w), window, padding


def test_padding_keeps_each_head_in_its_kv_group(bpe):
    """Hand case: a layer of 4 query heads over 2 KV heads padded to 3 per group: heads 0,1 | 3,4; 2 and 5 zero."""
    model = _gemma3(bpe, layers=2)
    prune_layer(model, "attention_head", 0, torch.tensor([0, 1, 3, 4]))
    dense = dense_tensors(model)
    q = dense.tensors["model.layers.0.self_attn.q_proj.weight"].clone()
    note = pad_to_uniform(dense)
    assert note is not None and dense.uniform
    padded = dense.tensors["model.layers.0.self_attn.q_proj.weight"]
    d = 12
    assert padded.shape[0] == 6 * d
    for source, target in enumerate([0, 1, 3, 4]):
        assert torch.equal(padded[target * d : (target + 1) * d], q[source * d : (source + 1) * d])
    assert not padded[2 * d : 3 * d].any() and not padded[5 * d :].any()
    assert dense.layer_widths[0]["num_attention_heads"] == 6 and dense.added_params == 2 * d * 48 * 2


def test_what_llamacpps_gemma3_would_compute_otherwise_is_refused(tmp_path, bpe):
    model = tiny_gemma3_text(vocab_size=len(bpe), layers=3)  # alternating sliding / full layers
    with pytest.raises(SlimkitError, match=r"^layer_types: llama.cpp's gemma3 makes every 6th layer full"):
        export(model, tmp_path / "a.gguf", "gguf", "f32", tokenizer=bpe)
    model = _gemma3(bpe, layers=2)
    model.config.query_pre_attn_scalar = 64
    with pytest.raises(SlimkitError, match=r"^query_pre_attn_scalar 64: llama.cpp's gemma3 scales"):
        export(model, tmp_path / "b.gguf", "gguf", "f32", tokenizer=bpe)
    model = _gemma3(bpe, layers=2)
    remove_block(model, Block(1, "mlp"))
    with pytest.raises(SlimkitError, match=r"^removed attention / MLP blocks: llama.cpp's gemma3 graph"):
        export(model, tmp_path / "c.gguf", "gguf", "f32", tokenizer=bpe)
    model = tiny_gemma2(vocab_size=len(bpe), layers=2)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(SlimkitError, match=r"^layer_types: llama.cpp's gemma2 makes every 2th layer full"):
        export(model, tmp_path / "d.gguf", "gguf", "f32", tokenizer=bpe)
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("factory", [tiny_granite, tiny_olmo2], ids=["granite", "olmo2"])
@pytest.mark.parametrize("pruned", [False, True])
def test_granite_and_olmo2_gguf_equal_pytorch_in_llamacpp(tmp_path, bpe, factory, pruned):
    """SiLU has no table in llama.cpp: with a float32 cache the whole model matches to float32 rounding."""
    model = factory(vocab_size=len(bpe), layers=4)
    family = model.config.model_type
    if pruned:
        for layer in ModelView(model).layers:
            prune_layer(model, "mlp_channel", layer.index, torch.arange(layer.mlp_width - 8 * layer.index))
        if family == "granite":
            prune_layer(model, "kv_group", 1, torch.tensor([0]))
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == family
    assert any("padded with zeros" in w for w in result.warnings) == pruned
    assert _diff(model, tmp_path / "m.gguf") <= EXACT
    remove_block(model, Block(2, "attention"))
    with pytest.raises(SlimkitError, match=rf"^removed attention / MLP blocks: llama.cpp's {family} graph"):
        export(model, tmp_path / "r.gguf", "gguf", "f32", tokenizer=bpe)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text", "granite", "olmo2", "phi3", "smollm3"])
def test_uniform_widths_export_as_a_plain_hugging_face_folder(tmp_path, bpe, family):
    """Uniform pruning keeps a config transformers builds: the folder is read back by stock transformers and its
    logits checked by the export itself (``max_abs_logit_diff``)."""
    model = DECODERS[family](vocab_size=len(bpe)) if family in DECODERS else tiny_same_as_llama(family, len(bpe))
    for layer in ModelView(model).layers:
        prune_layer(model, "mlp_channel", layer.index, torch.arange(48))
    result = export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-4


@pytest.mark.parametrize("case", ["dense", "partial_rotary", "per_layer"])
def test_phi3_ggufs_equal_pytorch_in_llamacpp(tmp_path, bpe, case):
    """Fused attn_qkv and ffn_up (gate first), NEOX RoPE over part of each head (Phi-4-mini's
    partial_rotary_factor), per-layer MLP widths and one layer's pruned heads padded back with zeros."""
    model = tiny_phi3(vocab_size=len(bpe), partial_rotary_factor=0.5 if case == "partial_rotary" else 1.0)
    if case == "per_layer":
        for layer in ModelView(model).layers:
            prune_layer(model, "mlp_channel", layer.index, torch.arange(layer.mlp_width - 8 * (layer.index % 3)))
        prune_layer(model, "attention_head", 2, torch.tensor([0, 2, 3, 5]))
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == "phi3"
    assert any("padded with zeros" in w for w in result.warnings) == (case == "per_layer")
    assert _diff(model, tmp_path / "m.gguf") <= EXACT
    if case == "partial_rotary":  # the file rotates 4 of 8 dimensions: a fully rotated twin differs
        full = tiny_phi3(vocab_size=len(bpe))
        full.load_state_dict(model.state_dict())
        assert _diff(full, tmp_path / "m.gguf") > 100 * EXACT


def test_phi3_heads_pruned_in_every_layer_are_padded_back_and_longrope_is_refused(tmp_path, bpe):
    """llama.cpp's phi3 takes K from attn_qkv at offset n_embd: the query heads must span the hidden size, so heads
    pruned everywhere are padded back (exact, no compute saved); where no padding fits, one line."""
    model = tiny_phi3(vocab_size=len(bpe))
    for index in range(3):
        prune_layer(model, "kv_group", index, torch.tensor([1]))  # 3 heads over 1 KV head in every layer
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert any(w.startswith("query heads padded back to 6") for w in result.warnings)
    assert _diff(model, tmp_path / "m.gguf") <= EXACT
    shape = {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 64}
    assert phi3_head_target([shape], 48) == (6, 1)  # one KV head, its group padded from 3 to 6 query heads
    assert phi3_head_target([shape, {**shape, "num_attention_heads": 2, "num_key_value_heads": 2}], 48) == (6, 2)
    assert phi3_head_refusal([shape], 48) is None
    # 3 KV heads and groups of 3 need 9 query heads, more than the 6 that span the hidden size
    reason = phi3_head_refusal([shape, {**shape, "num_key_value_heads": 3}], 48)
    assert reason is not None and reason.endswith("use --format hf or slimkit.load") and "\n" not in reason
    assert phi3_head_refusal([shape], 52) is not None  # 52 is no whole number of heads of 8
    gguf, _ = export_verdicts("phi3", None, None, {"hidden_size": 52, **shape})
    assert not gguf.ok and "llama.cpp's phi3" in gguf.detail
    gguf, _ = export_verdicts("phi3", None, None, {"hidden_size": 48, **shape})
    assert gguf.ok
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "longrope"}
    with pytest.raises(SlimkitError, match=r"^rope scaling 'longrope' is not written by slimkit's GGUF export"):
        export(model, tmp_path / "r.gguf", "gguf", "f32", tokenizer=bpe)


def test_export_verdicts_name_the_padding_and_the_removed_block_refusal():
    widths = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12}
    varying = {"0": {**widths, "intermediate_size": 64}, "1": {**widths, "intermediate_size": 48}}
    gguf, hf = export_verdicts("gemma3_text", varying, None)
    assert (gguf.format, gguf.ok) == ("gguf gemma3", True) and "padded with zeros" in gguf.detail
    assert not hf.ok
    removed = {"0": {**widths, "intermediate_size": 64}, "1": {**widths, "intermediate_size": 0}}
    gguf, _ = export_verdicts("olmo2", removed, None)
    assert not gguf.ok and "olmo2 graph runs every layer" in gguf.detail
