"""Damaged and hostile inputs: every one is refused with one ``error:`` line (exit status 2), no traceback,
nothing written, and no code from a model folder ever runs.

The table below builds each damaged input in ``tmp_path`` from a tiny model, runs the CLI in-process and
checks the line: that it names what is wrong (``fragment``) and, where there is one, the offending file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.primitives.surgery import prune_layer
from tests.cli.test_cli import run_cli
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import byte_tokenizer, tiny_bert, tiny_llama

SENTINEL = "CODE-RAN"
"""A file the planted Python code would write into ``tmp_path`` if anything imported it."""


# --- building damaged inputs -------------------------------------------------------------------------


def _plain(tmp_path: Path, name: str = "model") -> Path:
    """A plain Hugging Face folder: tiny llama + byte tokenizer."""
    tokenizer = byte_tokenizer()
    path = tmp_path / name
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _per_layer(tmp_path: Path) -> Path:
    """A slimkit folder with per-layer MLP widths 60, 56, 52 (per_layer_config, marked config)."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    for layer in ModelView(model).layers:
        width = layer.mlp_width - 4 * (layer.index + 1)
        prune_layer(model, "mlp_channel", layer.index, torch.arange(width))
    return slimkit.save(model, tokenizer, tmp_path / "model")


def _low_rank(tmp_path: Path) -> Path:
    """A slimkit folder whose layer-0 q projection is a rank-4 pair (manifest ``modules[0]``)."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    layer = ModelView(model).layer(0)
    layer.set_linear("q", LowRankLinear.from_linear(layer.linear("q"), 4))
    return slimkit.save(model, tokenizer, tmp_path / "model")


def _edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _plant_code(folder: Path, name: str) -> None:
    """A module that leaves a sentinel file next to the folder if it is ever imported."""
    (folder / name).write_text(f"open({str(folder.parent / SENTINEL)!r}, 'w').write('ran')\n")


def _recipe_file(tmp_path: Path, model: str | Path = "unused") -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(model)))
    return str(path)


def _run_with(tmp_path: Path, folder: Path) -> list[str]:
    """``recipe run --model FOLDER --out OUT``: the model given on the command line."""
    return ["recipe", "run", _recipe_file(tmp_path), "--model", str(folder), "--out", str(tmp_path / "out")]


def config_auto_map_model(tmp_path):
    folder = _plain(tmp_path)
    _plant_code(folder, "modeling_evil.py")
    _edit_json(folder / "config.json", lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"}))
    return ["inspect", str(folder)], folder


def tokenizer_config_auto_map(tmp_path):
    folder = _plain(tmp_path)
    _plant_code(folder, "tokenization_evil.py")
    _edit_json(
        folder / "tokenizer_config.json",
        lambda c: c.update(auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}),
    )
    return ["eval", str(folder), "--json", str(tmp_path / "results.json")], folder


def config_auto_map_tokenizer_only(tmp_path):
    folder = _plain(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(auto_map={"AutoTokenizer": ["tokenization_evil.T", None]}))
    return _run_with(tmp_path, folder), folder


def python_file_in_folder(tmp_path):
    folder = _plain(tmp_path)
    _plant_code(folder, "configuration_evil.py")
    return _run_with(tmp_path, folder), folder


def config_invalid_json(tmp_path):
    folder = _plain(tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama",')
    return ["inspect", str(folder)], folder


def config_not_an_object(tmp_path):
    folder = _plain(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    return ["eval", str(folder)], folder


def config_without_model_type(tmp_path):
    folder = _plain(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.pop("model_type"))
    return ["inspect", str(folder)], folder


def unsupported_model_type(tmp_path):
    """A compression recipe on a model type slimkit has no adapter for (eval and inspect take it)."""
    folder = _plain(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    return _run_with(tmp_path, folder), folder


def not_a_causal_lm(tmp_path):
    """``slimkit eval`` on a model type transformers builds as no causal LM."""
    folder = _plain(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(model_type="t5", architectures=None))
    return ["eval", str(folder)], folder


def no_weights(tmp_path):
    folder = _plain(tmp_path)
    (folder / "model.safetensors").unlink()
    return ["inspect", str(folder)], folder


def pickle_weights_only(tmp_path):
    folder = _plain(tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save(tiny_llama(vocab_size=len(byte_tokenizer())).state_dict(), folder / "pytorch_model.bin")
    return ["inspect", str(folder)], folder


def safetensors_truncated(tmp_path):
    folder = _plain(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return ["eval", str(folder), "--json", str(tmp_path / "results.json")], folder


def safetensors_garbage(tmp_path):
    folder = _plain(tmp_path)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 20)
    return _run_with(tmp_path, folder), folder


def shard_index_names_missing_file(tmp_path):
    folder = _plain(tmp_path)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["inspect", str(folder)], folder


def weights_not_named_model_safetensors(tmp_path):
    folder = _plain(tmp_path)
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    return ["inspect", str(folder)], folder


def intermediate_size_edited(tmp_path):
    folder = _plain(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.update(intermediate_size=80))
    return ["inspect", str(folder)], folder


def per_layer_config_deleted(tmp_path):
    folder = _per_layer(tmp_path)
    _edit_json(folder / "config.json", lambda c: c.pop("per_layer_config"))
    return ["inspect", str(folder)], folder


def per_layer_config_edited(tmp_path):
    folder = _per_layer(tmp_path)
    _edit_json(folder / "config.json", lambda c: c["per_layer_config"]["1"].update(intermediate_size=7))
    return ["eval", str(folder)], folder


def manifest_layer_widths_edited(tmp_path):
    folder = _per_layer(tmp_path)
    _edit_json(folder / "slimkit_manifest.json", lambda m: m["layer_widths"][1].update(intermediate_size=50))
    return ["inspect", str(folder)], folder


def manifest_rank_edited(tmp_path):
    folder = _low_rank(tmp_path)
    _edit_json(folder / "slimkit_manifest.json", lambda m: m["modules"][0].update(rank=5))
    return ["inspect", str(folder)], folder


def manifest_invalid_json(tmp_path):
    folder = _low_rank(tmp_path)
    (folder / "slimkit_manifest.json").write_text("{oops")
    return ["inspect", str(folder)], folder


def manifest_unknown_kind(tmp_path):
    folder = _low_rank(tmp_path)
    _edit_json(folder / "slimkit_manifest.json", lambda m: m["modules"][0].update(kind="sparse"))
    return ["inspect", str(folder)], folder


def manifest_path_not_in_model(tmp_path):
    folder = _low_rank(tmp_path)
    _edit_json(folder / "slimkit_manifest.json", lambda m: m["modules"][0].update(path="model.layers.9.mlp.up_proj"))
    return ["inspect", str(folder)], folder


def tokenizer_json_damaged(tmp_path):
    folder = _plain(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return ["inspect", str(folder)], folder


def eval_perplexity_on_encoder(tmp_path):
    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    return ["eval", str(folder), "--json", str(tmp_path / "results.json")], folder


def recipe_not_utf8(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1") + b"\xff\xfe\n")
    return ["recipe", "run", str(path), "--out", str(tmp_path / "out")], tmp_path


def eval_json_is_a_folder(tmp_path):
    (tmp_path / "results").mkdir()
    return ["eval", str(_plain(tmp_path)), "--json", str(tmp_path / "results")], None


def eval_json_folder_missing(tmp_path):
    return ["eval", str(_plain(tmp_path)), "--json", str(tmp_path / "missing" / "results.json")], None


def eval_json_parent_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    return ["eval", str(_plain(tmp_path)), "--json", str(tmp_path / "notes.txt" / "results.json")], None


# Already handled before this table; kept here so the table guards them.


def unknown_model_source(tmp_path):
    return ["eval", "gpt-5", "--json", str(tmp_path / "results.json")], None


def missing_model_folder(tmp_path):
    return ["inspect", str(tmp_path / "no-such-model")], None


def model_source_is_a_file(tmp_path):
    folder = _plain(tmp_path)
    return ["inspect", str(folder / "model.safetensors")], folder


def folder_without_config(tmp_path):
    folder = _plain(tmp_path)
    (folder / "config.json").unlink()
    return ["inspect", str(folder)], folder


def unknown_recipe_name(tmp_path):
    return ["recipe", "run", "wanda-chanels", "--out", str(tmp_path / "out")], None


def bad_set_path(tmp_path):
    file = _recipe_file(tmp_path, _plain(tmp_path))
    return ["recipe", "run", file, "--set", "stages.7.args.scorer=magnitude", "--out", str(tmp_path / "out")], None


class Case(NamedTuple):
    id: str
    build: Callable[[Path], tuple[list[str], Path | None]]
    fragment: str
    file: str | None = None
    """The offending file (relative to the built folder) the line must name; "" for the folder itself."""


CASES = [
    Case(
        "config-auto-map",
        config_auto_map_model,
        "auto_map names the folder's own code (AutoModelForCausalLM -> modeling_evil.Evil), which slimkit never runs",
        "config.json",
    ),
    Case(
        "tokenizer-config-auto-map",
        tokenizer_config_auto_map,
        "auto_map names the folder's own code (AutoTokenizer -> tokenization_evil.EvilTokenizer)",
        "tokenizer_config.json",
    ),
    Case(
        "config-auto-map-tokenizer-only",
        config_auto_map_tokenizer_only,
        "auto_map names the folder's own code (AutoTokenizer",
        "config.json",
    ),
    Case(
        "python-file-in-folder",
        python_file_in_folder,
        "holds Python code (configuration_evil.py), which slimkit never runs",
        "",
    ),
    Case("config-invalid-json", config_invalid_json, "config.json: not valid JSON", "config.json"),
    Case("config-not-an-object", config_not_an_object, "config.json: expected a JSON object, got list", "config.json"),
    Case("config-without-model-type", config_without_model_type, "config.json: no model_type", "config.json"),
    Case(
        "unsupported-model-type",
        unsupported_model_type,
        "model_type 'gpt2' is not supported for causal-lm recipes",
        "config.json",
    ),
    Case(
        "eval-not-a-causal-lm",
        not_a_causal_lm,
        "model_type 't5' is not a causal language model transformers builds",
        "config.json",
    ),
    Case("no-weights", no_weights, "holds no weights (no *.safetensors file)", ""),
    Case(
        "pickle-weights-only",
        pickle_weights_only,
        "holds only pickle weights (pytorch_model.bin); slimkit reads safetensors only",
        "",
    ),
    Case(
        "safetensors-truncated",
        safetensors_truncated,
        "model.safetensors: not a readable safetensors file",
        "model.safetensors",
    ),
    Case(
        "safetensors-garbage",
        safetensors_garbage,
        "model.safetensors: not a readable safetensors file",
        "model.safetensors",
    ),
    Case(
        "shard-index-names-missing-file",
        shard_index_names_missing_file,
        "names weight file(s) the folder lacks: model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ),
    Case(
        "weights-not-model-safetensors",
        weights_not_named_model_safetensors,
        "keeps its weights in model.safetensors",
        "",
    ),
    Case(
        "intermediate-size-edited",
        intermediate_size_edited,
        "config.json: intermediate_size (80) disagrees with the weights: model.safetensors holds "
        "model.layers.0.mlp.gate_proj.weight of shape [64, 48], the config builds [80, 48]",
        "config.json",
    ),
    Case(
        "per-layer-config-deleted",
        per_layer_config_deleted,
        "intermediate_size (64) disagrees with the weights: slimkit-model.safetensors holds "
        "model.layers.0.mlp.gate_proj.weight of shape [60, 48]",
        "config.json",
    ),
    Case(
        "per-layer-config-edited",
        per_layer_config_edited,
        "per_layer_config layer 1 disagrees with the weights: intermediate_size 7 (the weights give 56)",
        "config.json",
    ),
    Case(
        "manifest-layer-widths-edited",
        manifest_layer_widths_edited,
        "slimkit_manifest.json: layer_widths[1] disagrees with the weights: intermediate_size 50 (the weights give 56)",
        "slimkit_manifest.json",
    ),
    Case(
        "manifest-rank-edited",
        manifest_rank_edited,
        "modules[0] (low_rank at model.layers.0.self_attn.q_proj: rank 5, in_features 48, out_features 48) "
        "disagrees with the weights: slimkit-model.safetensors holds model.layers.0.self_attn.q_proj.first.weight "
        "of shape [4, 48], the entry implies [5, 48]",
        "slimkit_manifest.json",
    ),
    Case(
        "manifest-invalid-json", manifest_invalid_json, "slimkit_manifest.json: not valid JSON", "slimkit_manifest.json"
    ),
    Case(
        "manifest-unknown-kind",
        manifest_unknown_kind,
        "modules[0] has unknown kind 'sparse'; known: low_rank, rms_norm, basis_change",
        "slimkit_manifest.json",
    ),
    Case(
        "manifest-path-not-in-model",
        manifest_path_not_in_model,
        "modules[0] (low_rank): the model has no module model.layers.9.mlp.up_proj",
        "slimkit_manifest.json",
    ),
    Case("tokenizer-json-damaged", tokenizer_json_damaged, "cannot load the tokenizer", ""),
    Case("eval-perplexity-on-encoder", eval_perplexity_on_encoder, "perplexity needs a causal language model, and", ""),
    Case("recipe-not-utf8", recipe_not_utf8, "recipe.yaml: not UTF-8 text", "recipe.yaml"),
    Case("eval-json-is-a-folder", eval_json_is_a_folder, "results: is a folder; give a file path"),
    Case("eval-json-folder-missing", eval_json_folder_missing, "missing/results.json: folder"),
    Case("eval-json-parent-is-a-file", eval_json_parent_is_a_file, "notes.txt is not a folder"),
    Case("unknown-model-source", unknown_model_source, "unknown model source 'gpt-5'; known: smollm2-135m, minilm-l6"),
    Case("missing-model-folder", missing_model_folder, "no-such-model does not exist"),
    Case("model-source-is-a-file", model_source_is_a_file, "model.safetensors is a file; give the model folder", ""),
    Case("folder-without-config", folder_without_config, "has no config.json", ""),
    Case("unknown-recipe-name", unknown_recipe_name, "unknown recipe 'wanda-chanels'; did you mean 'wanda-channels'?"),
    Case("bad-set-path", bad_set_path, "--set stages.7.args.scorer: '7' is not an index of a list of 1"),
]


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_line(case, monkeypatch, capsys, tmp_path):
    args, folder = case.build(tmp_path)
    before = _snapshot(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.fragment in lines[0], lines[0]
    if case.file is not None:
        assert str(folder / case.file if case.file else folder) in lines[0], lines[0]
    # Nothing written: no --out / --json output, no staging folder, no sentinel from planted code.
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / SENTINEL).exists()


def test_the_table_covers_twenty_cases():
    assert len(CASES) >= 20 and len({case.id for case in CASES}) == len(CASES)


# --- the Python API refuses the same way -------------------------------------------------------------


@pytest.mark.parametrize("build", [config_auto_map_model, tokenizer_config_auto_map, python_file_in_folder])
def test_load_and_load_source_refuse_custom_code(build, tmp_path):
    _args, folder = build(tmp_path)
    for loader in (slimkit.load, slimkit.load_source):
        with pytest.raises(SlimkitError, match="which slimkit never runs") as error:
            loader(str(folder))
        assert "\n" not in str(error.value)
    assert not (tmp_path / SENTINEL).exists()


def test_transformers_loaders_get_trust_remote_code_false(monkeypatch, tmp_path):
    """Every transformers loader slimkit calls is told trust_remote_code=False (it never prompts [y/N])."""
    import transformers
    from transformers import LlamaForCausalLM

    calls: dict[str, list[dict]] = {}

    def spy(name, original):
        def wrapper(*args, **kwargs):
            calls.setdefault(name, []).append(kwargs)
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", spy("config", transformers.AutoConfig.from_pretrained)
    )
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", spy("tokenizer", transformers.AutoTokenizer.from_pretrained)
    )
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", spy("model", LlamaForCausalLM.from_pretrained))
    slimkit.load(_plain(tmp_path, "plain"))
    slimkit.load(_low_rank(tmp_path))  # the slimkit path: only the tokenizer goes through from_pretrained
    assert set(calls) == {"config", "tokenizer", "model"}
    assert all(kwargs.get("trust_remote_code") is False for each in calls.values() for kwargs in each), calls
    assert calls["model"][0].get("use_safetensors") is True


def test_intact_folders_still_load(tmp_path):
    """The up-front checks refuse nothing valid: plain, uniform slimkit (manifest), per-layer, low-rank, encoder."""
    tokenizer = byte_tokenizer()
    uniform = tiny_llama(vocab_size=len(tokenizer))
    for layer in ModelView(uniform).layers:
        prune_layer(uniform, "mlp_channel", layer.index, torch.arange(40))
    folders = {
        "plain": _plain(tmp_path, "plain"),
        "uniform": slimkit.save(uniform, tokenizer, tmp_path / "uniform"),
        "per-layer": _per_layer(tmp_path / "a"),
        "low-rank": _low_rank(tmp_path / "b"),
    }
    assert "per_layer_config" not in json.loads((folders["uniform"] / "config.json").read_text())
    for name, folder in folders.items():
        model, loaded_tokenizer = slimkit.load(folder)
        assert loaded_tokenizer is not None, name
        manifest = slimkit.primitives.io.read_manifest(folder)
        if manifest is not None:
            assert ModelView(model).layer_widths() == manifest["layer_widths"], name
    tiny_bert().save_pretrained(tmp_path / "bert")
    model, _ = slimkit.load(tmp_path / "bert")
    assert model.config.model_type == "bert"
    assert os.listdir(tmp_path / "bert")
