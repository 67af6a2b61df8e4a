"""`slimkit inspect` and the run report's structure: low-rank ranks, residual maps, which loaders read a folder."""

from __future__ import annotations

import json

import torch

import slimkit
from slimkit.engine.report import RunReport
from slimkit.engine.report_files import markdown, plot_widths
from slimkit.primitives.arch import ModelView
from slimkit.primitives.io.describe import (
    describe_model,
    folder_loaders,
    model_structure,
    saved_structure,
    structure_of,
)
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.primitives.projection.adapters import attach_basis_change
from slimkit.primitives.surgery import prune_layer
from tests.cli.test_cli import run_cli
from tests.tiny import tiny_llama


def _lowrank_with_map(tokenizer):
    """Layer 0: q rank 4, k rank 3; layer 2: down rank 6; a 48 -> 48 residual map on layer 1's input."""
    model = tiny_llama(vocab_size=len(tokenizer))
    view = ModelView(model)
    for index, role, rank in ((0, "q", 4), (0, "k", 3), (2, "down", 6)):
        layer = view.layer(index)
        layer.set_linear(role, LowRankLinear.from_linear(layer.linear(role), rank))
    attach_basis_change(view.layer(1).module, torch.eye(48))
    return model


def test_structure_from_manifest_records(tokenizer):
    model = _lowrank_with_map(tokenizer)
    structure = model_structure(model)
    assert structure.ranks == {0: {"q": 4, "k": 3}, 2: {"down": 6}}
    (residual,) = structure.residual_maps
    assert (residual.layer, residual.host, residual.hook, residual.shape) == (1, "model.layers.1", "input", (48, 48))
    assert residual.where == "input of model.layers.1"
    assert "3 low-rank pair(s) (ranks: q 4, k 3, down 6)" in structure.summary()
    assert "1 residual map(s) (layer(s) 1)" in structure.summary()
    outside = structure_of(
        [{"path": "model.norm.basis_change", "kind": "basis_change", "in_features": 8, "out_features": 6}], "llama"
    )
    assert outside.residual_maps[0].layer is None and outside.residual_maps[0].shape == (6, 8)
    assert structure_of([], "llama").empty


def test_loader_verdicts(tmp_path, tokenizer, llama):
    marked = slimkit.save(_lowrank_with_map(tokenizer), tokenizer, tmp_path / "lowrank")
    verdicts = {v.loader: v for v in folder_loaders(marked)}
    assert verdicts["slimkit.load"].answer == "yes"
    hf = verdicts["transformers from_pretrained"]
    assert hf.answer == "no" and "slimkit_compressed" in hf.detail and "3 low-rank pairs" in hf.detail
    assert "1 residual / basis-change map" in hf.detail
    gguf = verdicts["llama.cpp via slimkit export --format gguf"]  # the map on layer 1's input has no exact merge
    assert gguf.answer == "no" and "model.layers.1.basis_change" in gguf.detail
    assert verdicts["transformers via slimkit export --format hf"].answer == "no"

    for layer in ModelView(llama).layers:
        prune_layer(llama, "mlp_channel", layer.index, torch.arange(40))
    plain = slimkit.save(llama, tokenizer, tmp_path / "plain")
    plain_verdicts = {v.loader: v for v in folder_loaders(plain)}
    assert plain_verdicts["transformers from_pretrained"].answer == "yes"
    assert plain_verdicts["llama.cpp via slimkit export --format gguf"].detail.startswith("as gguf llama")
    assert "transformers via slimkit export --format hf" not in plain_verdicts  # already plain

    config = json.loads((marked / "config.json").read_text())  # as an older slimkit wrote it
    config["model_type"] = config.pop("slimkit_base_model_type")
    (marked / "config.json").write_text(json.dumps(config))
    old = {v.loader: v for v in folder_loaders(marked)}["transformers from_pretrained"]
    assert old.answer == "no" and "saved before" in old.detail


def test_inspect_command_shows_ranks_maps_and_loaders(monkeypatch, capsys, tmp_path, tokenizer):
    folder = slimkit.save(_lowrank_with_map(tokenizer), tokenizer, tmp_path / "m")
    code, out, err = run_cli(monkeypatch, capsys, "inspect", str(folder))
    assert code == 0, err
    assert "q: 4, k: 3" in out and "down: 6" in out
    assert "input 48->48" in out and "input of model.layers.1" in out and "48 x 48" in out
    assert "transformers from_pretrained" in out and "slimkit_compressed" in out
    assert "slimkit export --format gguf" in out
    description = describe_model(slimkit.load(folder)[0], folder).as_dict()
    assert description["structure"]["ranks"] == {"0": {"q": 4, "k": 3}, "2": {"down": 6}}
    assert [v["answer"] for v in description["loaders"]] == ["yes", "no", "no", "no"]


def test_inspect_plain_folder(monkeypatch, capsys, tiny_llama_dir):
    code, out, err = run_cli(monkeypatch, capsys, "inspect", str(tiny_llama_dir))
    assert code == 0, err
    assert "low-rank" not in out and "residual" not in out
    assert "uniform widths, no slimkit-only modules" in out


def test_width_plot_with_ranks_and_maps(tmp_path, tokenizer):
    model = _lowrank_with_map(tokenizer)
    widths = ModelView(model).layer_widths()
    folder = slimkit.save(model, tokenizer, tmp_path / "run" / "model")
    structure = saved_structure(folder)
    assert structure.ranks == {0: {"q": 4, "k": 3}, 2: {"down": 6}} and len(structure.residual_maps) == 1
    plot_widths(widths, widths, tmp_path / "with.png", structure)
    plot_widths(widths, widths, tmp_path / "without.png")
    assert (tmp_path / "with.png").stat().st_size > 1000 and (tmp_path / "without.png").stat().st_size > 1000
    assert saved_structure(tmp_path) is None  # no manifest there
    target = {"ratio": 0.2, "of": "model", "achieved": 0.2, "tolerance": 0.005, "strict": True, "met": True}
    report = {
        "recipe": "r",
        "model": "m",
        "seed": 0,
        "target": {**target, "shares": {}},
        "params": {
            "before": 10,
            "after": 8,
            "removed_ratio": 0.2,
            "by_part_before": dict.fromkeys(("attention", "mlp", "layers", "embeddings"), 5),
            "by_part_after": dict.fromkeys(("attention", "mlp", "layers", "embeddings"), 4),
        },
        "macs": {"before": 10, "after": 8, "seq_len": 16},
        "metrics": {},
        "timings_s": {"stages": {}, "total": 1.0},
        "peak_rss_mb": 1.0,
        "placement": {"device": "cpu", "dtype": "float32"},
        "evaluation": {},
        "calibration": None,
        "stages": {},
        "layers": {"before": widths, "after": widths},
        "notes": [],
        "versions": {},
    }
    report = RunReport.model_validate(report)
    text = markdown(report, "widths.png", structure)
    assert "Structure: 3 low-rank pair(s) (ranks: q 4, k 3, down 6); 1 residual map(s)" in text
    assert "Structure" not in markdown(report, "widths.png")


def test_lorap_run_report_mentions_the_ranks(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    import slimkit
    from tests.stages.test_lowrank_stage import lorap_recipe

    raw = lorap_recipe(tiny_llama_dir)
    slimkit.run(raw, tmp_path / "run", evaluate=False)
    assert "low-rank pair(s) (ranks: q" in (tmp_path / "run" / "report.md").read_text()
    assert (tmp_path / "run" / "widths.png").stat().st_size > 1000
    code, out, err = run_cli(monkeypatch, capsys, "inspect", str(tmp_path / "run" / "model"))
    assert code == 0, err
    assert "q: " in out and "slimkit_compressed" in out
