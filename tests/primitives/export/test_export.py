"""Export: dense merges, GGUF for llama.cpp (llama / deci), plain Hugging Face folders, CLI and recipe section.

llama.cpp itself (llama-cpp-python, installed by ``make install``) reads every GGUF written here and its
logits are compared with the PyTorch model's on the same token ids.
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch
import transformers

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.llamacpp import gguf_logits, nll_perplexity
from slimkit.primitives.export import dense_tensors, export
from slimkit.primitives.export.gguf_file import llama3_rope_factors, rope_permute
from slimkit.primitives.export.gguf_vocab import pre_tokenizer_name
from slimkit.primitives.io.describe import folder_loaders
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.primitives.projection import ProjectionSettings, project_hidden_dimension
from slimkit.recipes.loading import validate
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.conftest import saved_tiny_llama
from tests.primitives.io.test_io import _prune_non_uniform
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import FAMILIES, bpe_tokenizer, model_output, spm_tokenizer, tiny_bert, tiny_llama

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")

IDS = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()
TOLERANCE = {"f32": 1e-3, "f16": 5e-3, "bf16": 3e-2, "q8_0": 3e-2}
"""Max abs logit difference to PyTorch, as a fraction of the largest logit (llama.cpp accumulates in its own order)."""


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


def _torch_logits(model, ids=IDS) -> torch.Tensor:
    return model_output(model, torch.tensor([ids]))[0].float()


def assert_llamacpp_matches(model, path, type="f32", ids=IDS) -> None:
    expected = _torch_logits(model, ids)
    actual = torch.tensor(gguf_logits(path, ids, threads=2))
    scale = max(float(expected.abs().max()), 1.0)
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) <= TOLERANCE[type] * scale


def _tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def _field(path, key):
    return gguf.GGUFReader(path).fields[key].contents()


def _no_partials(folder) -> bool:
    return not [p for p in folder.iterdir() if ".partial-" in p.name]


def _lowrank(model: torch.nn.Module) -> torch.nn.Module:
    view = ModelView(model)
    for index, role, rank in ((0, "q", 4), (0, "k", 3), (2, "down", 6)):
        layer = view.layer(index)
        layer.set_linear(role, LowRankLinear.from_linear(layer.linear(role), rank))
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (4, 16), generator=generator) for _ in range(2)]


# -- pure pieces --------------------------------------------------------------------------------


def test_rope_permute_interleaves_the_halves_of_each_head():
    rows = torch.arange(8.0)[:, None]  # two heads of four rows: [x0 x1 y0 y1] per head
    assert rope_permute(rows, heads=2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert rope_permute(torch.arange(4.0), heads=1).tolist() == [0, 2, 1, 3]  # a bias too
    with pytest.raises(ValueError):
        rope_permute(torch.zeros(6, 2), heads=2)


def test_llama3_rope_factors_hand_case():
    # wavelength 2*pi*base^(i/d): short waves keep 1, long waves get the factor, the middle is smoothed
    factors = llama3_rope_factors(
        {
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        head_dim=8,
    )
    wavelengths = 2 * torch.pi * 10000.0 ** (torch.arange(0, 8, 2) / 8)  # 6.3, 62.8, 628, 6283
    assert wavelengths[0] < 64 / 4 and factors[0] == 1.0
    assert wavelengths[2] > 64 and wavelengths[3] > 64 and factors[2] == factors[3] == 8.0
    smooth = (64 / wavelengths[1] - 1) / 3
    assert factors[1] == pytest.approx(float(1 / ((1 - smooth) / 8 + smooth)), rel=1e-6)


def test_dense_merge_of_low_rank_pairs_is_exact_and_counts_the_growth():
    model = _lowrank(tiny_llama())
    dense = dense_tensors(model)
    q = model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(
        dense.tensors["model.layers.0.self_attn.q_proj.weight"], q.second.weight @ q.first.weight
    )
    assert not [k for k in dense.tensors if ".first." in k or ".second." in k]
    pair_params = sum(p.numel() for n, p in model.named_parameters() if ".first." in n or ".second." in n)
    dense_params = 48 * 48 + 16 * 48 + 48 * 64  # q (6 heads x 8), k (2 x 8), down
    assert dense.added_params == dense_params - pair_params
    assert dense.merged == ["3 low-rank pairs into dense matrices (down_proj x1, k_proj x1, q_proj x1)"]
    assert dense.tied and "lm_head.weight" not in dense.tensors


def test_pre_tokenizer_hash_of_an_unknown_tokenizer_is_reported(bpe):
    name, digest = pre_tokenizer_name(bpe)
    assert name is None and len(digest) == 64


# -- GGUF in llama.cpp --------------------------------------------------------------------------


@pytest.mark.parametrize("type", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("tie", [True, False])
def test_uniform_model_is_llama_and_llamacpp_matches(tmp_path, bpe, type, tie):
    model = tiny_llama(tie=tie)
    path = tmp_path / "m.gguf"
    result = export(model, path, "gguf", type, tokenizer=bpe)
    assert result.architecture == "llama" and _field(path, "general.architecture") == "llama"
    assert ("output.weight" in _tensor_types(path)) == (not tie)
    assert result.tokenizer_pre == "default" and "not recognised" in result.warnings[0]
    assert_llamacpp_matches(model, path, type)
    assert _no_partials(tmp_path)


def test_q8_0_falls_back_per_tensor_where_rows_are_not_blocks_of_32(tmp_path, bpe):
    path = tmp_path / "q.gguf"
    result = export(tiny_llama(), path, "gguf", "q8_0", tokenizer=bpe)
    types = _tensor_types(path)
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 64 (the MLP width)
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"  # rows of 48
    assert "blk.0.attn_q.weight: rows of 48 are not a multiple of 32, written as f16" in result.fallbacks
    assert not [f for f in result.fallbacks if "ffn_down" in f]


def test_per_layer_widths_are_deci_and_llamacpp_matches(tmp_path, bpe):
    torch.manual_seed(0)
    model = tiny_llama()
    _prune_non_uniform(model)
    path = tmp_path / "het.gguf"
    result = export(model, path, "gguf", "f32", tokenizer=bpe)
    assert result.architecture == "deci"
    assert list(_field(path, "deci.attention.head_count")) == [3, 6, 6]
    assert list(_field(path, "deci.attention.head_count_kv")) == [1, 2, 2]
    assert list(_field(path, "deci.feed_forward_length")) == [60, 56, 52]
    assert_llamacpp_matches(model, path)


def test_llamacpp_refuses_per_layer_arrays_under_the_llama_architecture(tmp_path, bpe, monkeypatch):
    """Why per-layer widths go to deci: the same file labelled llama does not load."""
    torch.manual_seed(0)
    model = tiny_llama()
    _prune_non_uniform(model)
    from slimkit.primitives.export import gguf_file

    writer = gguf_file.gguf.GGUFWriter
    monkeypatch.setattr(gguf_file.gguf, "GGUFWriter", lambda path, arch, **kw: writer(path, "llama", **kw))
    export(model, tmp_path / "llama.gguf", "gguf", "f32", tokenizer=bpe)
    with pytest.raises(SlimkitError, match="could not load"):
        gguf_logits(tmp_path / "llama.gguf", IDS[:8], threads=2)


def test_low_rank_pairs_merge_into_gguf_and_a_plain_hf_folder(tmp_path, bpe):
    model = _lowrank(tiny_llama())
    result = export(model, tmp_path / "lr.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.added_params > 0 and result.merged[0].startswith("3 low-rank pairs")
    assert_llamacpp_matches(model, tmp_path / "lr.gguf")
    hf = export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not [name for name in plain.state_dict() if ".first." in name]
    torch.testing.assert_close(_torch_logits(plain), _torch_logits(model), rtol=0, atol=1e-5)
    assert hf.max_abs_logit_diff is not None and hf.max_abs_logit_diff < 1e-5
    assert not (tmp_path / "hf" / "slimkit_manifest.json").exists()


@pytest.mark.parametrize("tied_head", ["joint", "shared"])
def test_one_group_sp3_projection_is_plain_llama_with_its_maps_folded(tmp_path, bpe, tied_head):
    model = tiny_llama(layers=4)
    settings = ProjectionSettings(group_size=None, ratio=0.25, tied_head=tied_head)
    project_hidden_dimension(model, _batches(), settings)
    dense = dense_tensors(model)
    assert dense.hidden_size == 36 and not dense.tied
    assert any("final norm" in text for text in dense.merged)
    result = export(model, tmp_path / "sp3.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == "llama" and _field(tmp_path / "sp3.gguf", "llama.embedding_length") == 36
    assert_llamacpp_matches(model, tmp_path / "sp3.gguf")
    export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert plain.config.hidden_size == 36 and plain.config.head_dim == 8
    torch.testing.assert_close(_torch_logits(plain), _torch_logits(model), rtol=0, atol=1e-5)


def test_residual_matrices_between_groups_are_refused_in_one_line(tmp_path, bpe):
    model = tiny_llama(layers=4)
    project_hidden_dimension(model, _batches(), ProjectionSettings(group_size=2, ratio=0.25))
    for format in ("gguf", "hf"):
        out = tmp_path / ("m.gguf" if format == "gguf" else "hf")
        with pytest.raises(SlimkitError, match=r"no exact merge.*group_size: all") as error:
            export(model, out, format, tokenizer=bpe)
        assert "\n" not in str(error.value) and not out.exists()
    assert _no_partials(tmp_path)


def test_llama3_rope_scaling_is_written_and_llamacpp_matches(tmp_path, bpe):
    model = tiny_llama()
    model.config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = type(model)(model.config)  # rebuild the rotary embedding from the scaled config
    export(model, tmp_path / "r.gguf", "gguf", "f32", tokenizer=bpe)
    assert "rope_freqs.weight" in _tensor_types(tmp_path / "r.gguf")
    assert_llamacpp_matches(model, tmp_path / "r.gguf")


def test_perplexity_in_llamacpp_equals_the_torch_formula(tmp_path, bpe):
    model = tiny_llama()
    export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    with torch.no_grad():
        loss = model(torch.tensor([IDS]), labels=torch.tensor([IDS])).loss
    assert nll_perplexity(gguf_logits(tmp_path / "m.gguf", IDS, threads=2), IDS) == pytest.approx(
        float(torch.exp(loss)), rel=1e-4
    )


# -- plain Hugging Face -------------------------------------------------------------------------


def test_hf_refuses_per_layer_widths_and_points_to_gguf(tmp_path, bpe):
    torch.manual_seed(0)
    model = tiny_llama()
    _prune_non_uniform(model)
    with pytest.raises(SlimkitError, match=r"intermediate_size.*vary.*--format gguf"):
        export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    assert not (tmp_path / "hf").exists() and _no_partials(tmp_path)


def test_export_reads_a_saved_slimkit_folder(tmp_path, bpe):
    model = _lowrank(tiny_llama(vocab_size=len(bpe)))
    folder = slimkit.save(model, bpe, tmp_path / "saved")
    result = export(folder, tmp_path / "m.gguf", "gguf", "f16")
    assert result.merged and result.tokenizer_pre == "default"
    assert_llamacpp_matches(model, tmp_path / "m.gguf", "f16")


# -- bad input ----------------------------------------------------------------------------------


def test_bad_arguments_and_outputs_are_one_line_before_any_work(tmp_path, bpe):
    model = tiny_llama()
    cases = [
        (dict(format="onnx"), "export format 'onnx' is not one of gguf, hf"),
        (dict(format="gguf", type="q4_k"), "GGUF type 'q4_k' is not one of f32, f16, bf16, q8_0"),
        (dict(format="hf", type="f16"), "--type applies to --format gguf only"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SlimkitError, match=message.replace("(", r"\(")):
            export(model, tmp_path / "x", tokenizer=bpe, **kwargs)
    with pytest.raises(
        SlimkitError,
        match="model types llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, granite, olmo2, olmo3, glm4, "
        "phi3, mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, nemotron_h, granitemoehybrid; this model is 'bert'",
    ):
        export(tiny_bert(), tmp_path / "b.gguf", "gguf", tokenizer=bpe)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SlimkitError, match="exists; pass --force"):
        export(model, tmp_path / "notes.txt", "gguf", tokenizer=bpe)
    with pytest.raises(SlimkitError, match="not a GGUF file; --force replaces only GGUF files"):
        export(model, tmp_path / "notes.txt", "gguf", tokenizer=bpe, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "thesis.tex").write_text("x")
    with pytest.raises(SlimkitError, match="is a folder"):
        export(model, tmp_path / "thesis", "gguf", tokenizer=bpe)
    with pytest.raises(SlimkitError, match=r"not a model folder.*--force replaces only model folders"):
        export(model, tmp_path / "thesis", "hf", tokenizer=bpe, force=True)
    assert (tmp_path / "thesis" / "thesis.tex").exists()
    export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    first = (tmp_path / "m.gguf").read_bytes()
    export(tiny_llama(), tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe, force=True)  # replaces a GGUF
    assert (tmp_path / "m.gguf").read_bytes() != first
    assert _no_partials(tmp_path)


def test_cli_export_and_its_errors(monkeypatch, capsys, tmp_path, bpe):
    folder = slimkit.save(tiny_llama(vocab_size=len(bpe)), bpe, tmp_path / "saved")
    code, out, err = run_cli(
        monkeypatch, capsys, "export", str(folder), "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"
    )
    assert code == 0, err
    assert "GGUF llama q8_0" in out and "fell back to f16" in out and "not recognised" in out
    code, out, err = run_cli(monkeypatch, capsys, "export", str(folder), "--out", str(tmp_path / "m.gguf"))
    assert_one_line_error(code, err, "exists; pass --force")
    code, out, err = run_cli(
        monkeypatch, capsys, "export", str(folder), "--out", str(tmp_path / "x"), "--format", "tflite"
    )
    assert_one_line_error(code, err, "export format 'tflite' is not one of gguf, hf")
    code, out, err = run_cli(
        monkeypatch, capsys, "export", str(folder), "--out", str(tmp_path / "hf"), "--format", "hf"
    )
    assert code == 0, err
    assert "plain Hugging Face folder" in out and (tmp_path / "hf" / "model.safetensors").exists()


# -- the recipe's export section ----------------------------------------------------------------


@pytest.fixture
def tiny_bpe_llama_dir(tmp_path, bpe):
    return saved_tiny_llama(tmp_path / "tiny-bpe-llama", bpe)  # GGUF needs a tokenizer with merges


def test_recipe_export_section_writes_gguf_and_hf_and_reports_loaders(tmp_path, tiny_bpe_llama_dir):
    raw = tiny_recipe(tiny_bpe_llama_dir, export=[{"format": "gguf", "type": "f32"}, {"format": "hf"}])
    out = tmp_path / "run"
    report = slimkit.run(raw, out).report.as_json()
    gguf_item, hf_item = report["export"]
    assert gguf_item["path"] == "export/model-f32.gguf" and gguf_item["architecture"] == "llama"
    assert hf_item["path"] == "export/hf" and hf_item["max_abs_logit_diff"] < 1e-4
    model, _ = slimkit.load(out / "model")
    assert_llamacpp_matches(model, out / "export" / "model-f32.gguf")
    loaders = {item["loader"]: item["answer"] for item in report["loaders"]}
    assert (
        loaders["transformers from_pretrained"] == "yes"
        and loaders["llama.cpp via slimkit export --format gguf"] == "yes"
    )
    text = (out / "report.md").read_text()
    assert "Export gguf to export/model-f32.gguf" in text and "Readable by:" in text
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["export"][0]["architecture"] == "llama"


def test_recipe_export_that_cannot_merge_keeps_the_run_and_fails_loudly(tmp_path, tiny_bpe_llama_dir):
    raw = tiny_recipe(
        tiny_bpe_llama_dir,
        target={"ratio": 0.2, "of": "model", "tolerance": 0.2, "strict": False},
        stages=[{"stage": "pca_project", "args": {"group_size": 1, "ratio": 0.2}}],
        export={"format": "gguf"},
    )
    out = tmp_path / "run"
    with pytest.raises(
        SlimkitError, match=r"the model and report are in .*1 export\(s\) failed: gguf .*no exact merge"
    ):
        slimkit.run(raw, out)
    report = json.loads((out / "report.json").read_text())
    assert "error" in report["export"][0] and (out / "model" / "config.json").exists()
    assert not (out / "export" / "model-f16.gguf").exists()


def test_recipe_export_is_refused_up_front_for_an_encoder_or_without_an_output(tmp_path, tiny_bpe_llama_dir):
    raw = tiny_recipe(tiny_bpe_llama_dir, export={"format": "gguf", "path": "../escape.gguf"})
    with pytest.raises(SlimkitError, match="must be a relative path inside the output folder"):
        validate(raw, "t")
    raw = tiny_recipe(tiny_bpe_llama_dir, export={"format": "gguf"})
    with pytest.raises(SlimkitError, match="give the run an output folder"):
        slimkit.run(validate(raw, "t"))


def test_a_hidden_size_llama_config_refuses_is_gguf_only(tmp_path, bpe):
    model = tiny_llama(layers=4)
    project_hidden_dimension(model, _batches(), ProjectionSettings(group_size=None, ratio=0.3))
    assert ModelView(model).hidden_size == 34  # not a multiple of the 6 heads
    with pytest.raises(
        SlimkitError, match=r"LlamaConfig refuses these widths \(The hidden size \(34\) is not a multiple"
    ):
        export(model, tmp_path / "hf", "hf", tokenizer=bpe)
    assert not (tmp_path / "hf").exists()
    export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert_llamacpp_matches(model, tmp_path / "m.gguf")
    verdicts = {v.loader: v for v in folder_loaders(slimkit.save(model, bpe, tmp_path / "saved"))}
    assert verdicts["llama.cpp via slimkit export --format gguf"].answer == "yes"
    assert "refuses" in verdicts["transformers via slimkit export --format hf"].detail


def _llamacpp_tokens(path, text: str) -> list[int]:
    from slimkit.primitives.evaluate.llamacpp import load_gguf

    model = load_gguf(path, n_ctx=64, threads=1)
    try:
        return list(model.tokenize(text.encode(), add_bos=False, special=False))
    finally:
        model.close()


def test_sentencepiece_style_tokenizer_is_llamas_with_scores_and_byte_tokens(tmp_path):
    tokenizer = spm_tokenizer()
    model = tiny_llama()
    result = export(model, tmp_path / "spm.gguf", "gguf", "f32", tokenizer=tokenizer)
    assert _field(tmp_path / "spm.gguf", "tokenizer.ggml.model") == "llama" and not result.warnings
    assert_llamacpp_matches(model, tmp_path / "spm.gguf")
    text = "the hat the\u00e9"  # merges, plain pieces and a byte-fallback character
    assert _llamacpp_tokens(tmp_path / "spm.gguf", text) == tokenizer(text, add_special_tokens=False).input_ids


def test_byte_level_tokenizer_tokenizes_text_like_hugging_face_in_llamacpp(tmp_path, bpe):
    export(tiny_llama(), tmp_path / "bpe.gguf", "gguf", "f32", tokenizer=bpe)
    text = "the the theme"
    assert _llamacpp_tokens(tmp_path / "bpe.gguf", text) == bpe(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_llama_family_models_run_in_llamacpp(tmp_path, bpe, family):
    model = FAMILIES[family]()
    result = export(model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe)
    assert result.architecture == ("llama" if family == "mistral" else family)
    if family == "mistral":  # the 4096 window is longer than the tiny model's 256 context: nothing lost
        assert not [text for text in result.warnings if "sliding_window" in text]
        short = export(FAMILIES[family](sliding_window=16), tmp_path / "w.gguf", "gguf", "f32", tokenizer=bpe)
        assert any("sliding_window 16 is not written" in text for text in short.warnings)
    if family == "qwen3":
        assert "blk.0.attn_q_norm.weight" in _tensor_types(tmp_path / "m.gguf")
    assert_llamacpp_matches(model, tmp_path / "m.gguf")
    verdicts = {v.loader: v for v in folder_loaders(slimkit.save(model, bpe, tmp_path / "saved"))}
    assert verdicts["llama.cpp via slimkit export --format gguf"].answer == "yes"


def test_per_layer_qwen_widths_are_refused_for_gguf(tmp_path, bpe):
    model = FAMILIES["qwen2"]()
    _prune_non_uniform(model)
    with pytest.raises(SlimkitError, match=r"per-layer widths of a qwen2 model: llama\.cpp's deci"):
        export(model, tmp_path / "m.gguf", "gguf", tokenizer=bpe)
    assert not (tmp_path / "m.gguf").exists() and _no_partials(tmp_path)


def test_force_swaps_a_plain_folder_in_and_leaves_nothing_beside_it(tmp_path, bpe):
    export(tiny_llama(), tmp_path / "hf", "hf", tokenizer=bpe)
    first = (tmp_path / "hf" / "model.safetensors").read_bytes()
    with pytest.raises(SlimkitError, match="exists and is not empty; pass --force"):
        export(tiny_llama(), tmp_path / "hf", "hf", tokenizer=bpe)
    result = export(tiny_llama(), tmp_path / "hf", "hf", tokenizer=bpe, force=True)
    assert result.path == tmp_path / "hf" and (tmp_path / "hf" / "model.safetensors").read_bytes() != first
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
