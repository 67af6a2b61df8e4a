"""Hostile inputs, round three: the two round-2 leftovers, the dense comparison's cache (class 2), non-finite weights
(class 4), the Python API's argument types (class 6) and values bounded before any compute (class 7).

Each refusal asserts one ``error:`` line naming what is wrong, exit status 2 and a file tree under ``tmp_path``
byte-for-byte as it was (nothing written, nothing replaced); a cache problem asserts a kept result and a note.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.reference import CACHE_FOLDER
from slimkit.recipes.loading import load_recipe
from tests.cli.test_cli import run_cli
from tests.contracts.hostile import (
    copy_model,
    edit_json,
    plain_model,
    recipe_file,
    tree_checksum,
    weights_of,
    write_weights,
)
from tests.recipes.test_recipes import tiny_recipe

SMALL_EVAL = ["--seq-len", "32", "--max-tokens", "128"]
TIME_LIMIT_S = 120


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return plain_model(tmp_path_factory.mktemp("round3"))


def nan_model(tmp: Path, template: Path, name: str = "model.layers.1.mlp.up_proj.weight") -> Path:
    folder = copy_model(template, tmp)
    tensors = weights_of(folder / "model.safetensors")
    tensors[name][2, 3] = float("nan")
    write_weights(folder / "model.safetensors", tensors)
    return folder


def long_path(root: Path, total: int) -> Path:
    """A path of exactly ``total`` bytes under ``root``, of components of at most 200 bytes (the last one 60 to 120,
    short enough for its staging sibling); every folder above it made."""
    parts, length = [], len(str(root))
    while (rest := total - length - 1) > 120:
        size = min(200, rest - 60)
        parts.append("a" * size)
        length += size + 1
    parts.append("b" * rest)
    path = root.joinpath(*parts)
    path.parent.mkdir(parents=True)
    assert len(os.fsencode(str(path))) == total
    return path


class Case(NamedTuple):
    id: str
    cls: str
    build: Callable[[Path, Path, pytest.MonkeyPatch], list[str]]
    fragment: str


# --- the two round-2 leftovers ----------------------------------------------------------------------------------


def bare_model_class(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(template, tmp)
    edit_json(folder / "config.json", lambda c: c.update(architectures=["LlamaModel"]))
    return ["eval", str(folder), *SMALL_EVAL]


def bare_model_class_in_a_run(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(template, tmp)
    edit_json(folder / "config.json", lambda c: c.update(architectures=["LlamaModel"]))
    return ["recipe", "run", str(recipe_file(tmp, folder)), "--out", str(tmp / "out")]


def cache_dir_is_a_file_eval(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "cachefile").write_text("mine")
    mp.setenv("SLIMKIT_CACHE_DIR", str(tmp / "cachefile"))
    return ["eval", str(template), *SMALL_EVAL]


def cache_dir_is_a_file_run(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "cachefile").write_text("mine")
    mp.setenv("SLIMKIT_CACHE_DIR", str(tmp / "cachefile"))
    return ["recipe", "run", str(recipe_file(tmp, template)), "--out", str(tmp / "out")]


def cache_dir_below_a_file(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """A read-only or missing home folder is blamed on the cache folder, not on the c4 dataset."""
    (tmp / "home").write_text("not a folder")
    mp.setenv("HOME", str(tmp / "home"))
    mp.delenv("SLIMKIT_CACHE_DIR")
    return ["recipe", "run", str(recipe_file(tmp, template)), "--out", str(tmp / "out")]


# --- class 4: non-finite weights --------------------------------------------------------------------------------


def nan_export(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["export", str(nan_model(tmp, template)), "--out", str(tmp / "m.gguf")]


def nan_export_hf(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["export", str(nan_model(tmp, template)), "--format", "hf", "--out", str(tmp / "hf")]


def nan_eval(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["eval", str(nan_model(tmp, template)), *SMALL_EVAL]


def inf_run(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(template, tmp)
    tensors = weights_of(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    write_weights(folder / "model.safetensors", tensors)
    return ["recipe", "run", str(recipe_file(tmp, folder)), "--out", str(tmp / "out")]


# --- class 7: values bounded before any compute -----------------------------------------------------------------


def _lora_recipe(tmp: Path, template: Path, **args) -> list[str]:
    recipe = tiny_recipe(template)
    recipe["stages"].append({"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 16, **args}})
    path = tmp / "lora.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return ["recipe", "run", str(path), "--out", str(tmp / "out")]


def lora_rank_above_widths(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return _lora_recipe(tmp, template, rank=100_000)


def lora_absurd_learning_rate(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return _lora_recipe(tmp, template, learning_rate=1e6)


def lora_unknown_module(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return _lora_recipe(tmp, template, target_modules=["q_proj", "wq"])


def lora_windows_past_positions(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return _lora_recipe(tmp, template, seq_len=4096)


def out_4044_bytes(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["recipe", "run", str(recipe_file(tmp, template)), "--out", str(long_path(tmp, 4044))]


def export_4090_bytes(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["export", str(template), "--out", str(long_path(tmp, 4090))]


def eval_json_4090_bytes(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["eval", str(template), *SMALL_EVAL, "--json", str(long_path(tmp, 4090))]


def out_name_too_long_for_its_staging_sibling(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["recipe", "run", str(recipe_file(tmp, template)), "--out", str(tmp / ("x" * 230))]


def out_of_an_unknown_user(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    mp.chdir(tmp)
    return ["recipe", "run", str(recipe_file(tmp, template)), "--out", "~nosuchuser-slimkit/x"]


def export_of_an_unknown_user(tmp: Path, template: Path, mp: pytest.MonkeyPatch) -> list[str]:
    mp.chdir(tmp)
    return ["export", str(template), "--out", "~nosuchuser-slimkit/m.gguf"]


CASES = [
    Case("eval-bare-model-class", "leftover", bare_model_class, "LlamaModel, which has no language-model head"),
    Case("run-bare-model-class", "leftover", bare_model_class_in_a_run, "has no language-model head"),
    Case("cache-dir-is-a-file-eval", "leftover", cache_dir_is_a_file_eval, "cachefile is not a folder"),
    Case("cache-dir-is-a-file-run", "leftover", cache_dir_is_a_file_run, "cachefile is not a folder"),
    Case("home-is-a-file", "leftover", cache_dir_below_a_file, "(SLIMKIT_CACHE_DIR unset) cannot be created"),
    Case("nan-export-gguf", "4", nan_export, "weight model.layers.1.mlp.up_proj.weight holds NaN or inf"),
    Case("nan-export-hf", "4", nan_export_hf, "weight model.layers.1.mlp.up_proj.weight holds NaN or inf"),
    Case("nan-eval", "4", nan_eval, "weight model.layers.1.mlp.up_proj.weight holds NaN or inf"),
    Case("inf-run", "4", inf_run, "weight model.layers.1.mlp.up_proj.weight holds NaN or inf"),
    Case("lora-rank", "7", lora_rank_above_widths, "lora: rank 100000 is more than the model's hidden size 48"),
    Case("lora-learning-rate", "7", lora_absurd_learning_rate, "args.learning_rate: Input should be less than"),
    Case("lora-module", "7", lora_unknown_module, "lora: target_modules: lora target module 'wq' not in the model"),
    Case("lora-seq-len", "7", lora_windows_past_positions, "stages.1 (lora): args.seq_len 4096 is longer"),
    Case("out-4044-bytes", "7", out_4044_bytes, "--out: the path is 4044 bytes"),
    Case("export-4090-bytes", "7", export_4090_bytes, "--out: the path is 4090 bytes"),
    Case("eval-json-4090-bytes", "7", eval_json_4090_bytes, "--json: the path is 4090 bytes"),
    Case("out-name-230-bytes", "7", out_name_too_long_for_its_staging_sibling, "a staging sibling needs"),
    Case("out-unknown-user", "7", out_of_an_unknown_user, "cannot expand ~nosuchuser-slimkit: no user named"),
    Case("export-unknown-user", "7", export_of_an_unknown_user, "cannot expand ~nosuchuser-slimkit: no user"),
]


class _Blocked(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Blocked("the command blocked")


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_round3_input_is_refused_in_one_line(case, template, monkeypatch, capsys, tmp_path):
    args = case.build(tmp_path, template, monkeypatch)
    before = tree_checksum(tmp_path)
    template_before = tree_checksum(template)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        code, out, err = run_cli(monkeypatch, capsys, *args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.fragment in lines[0], lines[0]
    assert tree_checksum(tmp_path) == before
    assert tree_checksum(template) == template_before


def test_each_class_has_several_cases():
    per_class: dict[str, int] = {}
    for case in CASES:
        per_class[case.cls] = per_class.get(case.cls, 0) + 1
    assert len({case.id for case in CASES}) == len(CASES)
    assert all(count >= 3 for count in per_class.values()), per_class


# --- class 2: the dense comparison's cache never costs the run -------------------------------------------------


def _run(monkeypatch, capsys, recipe: Path, out: Path) -> dict:
    code, _out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(recipe), "--out", str(out))
    assert code == 0, err
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_dense_cache_follows_the_weights_content(template, tmp_path, monkeypatch, capsys):
    """Weights rewritten in place with their modification time kept (touch -r, tar, rsync -a) are measured again."""
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = copy_model(template, tmp_path)
    recipe = recipe_file(tmp_path, folder)
    first = _run(monkeypatch, capsys, recipe, tmp_path / "o1")
    assert first["dense"]["cached"] is False
    assert _run(monkeypatch, capsys, recipe, tmp_path / "o2")["dense"] == {**first["dense"], "cached": True}
    weights = folder / "model.safetensors"
    stamp = weights.stat()
    tensors = weights_of(weights)
    tensors["model.layers.0.mlp.down_proj.weight"] *= 3.0
    write_weights(weights, tensors)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    third = _run(monkeypatch, capsys, recipe, tmp_path / "o3")
    assert third["dense"]["cached"] is False
    assert third["dense"]["metrics"] != first["dense"]["metrics"]


@pytest.mark.slow
def test_bad_dense_cache_entries_and_folders_keep_the_run(template, tmp_path, monkeypatch, capsys):
    """A FIFO or a NaN entry is measured again, a blocked entries' folder is a note; the run's result is kept."""
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    recipe = recipe_file(tmp_path, template)
    dense = _run(monkeypatch, capsys, recipe, tmp_path / "o1")["dense"]
    (entry,) = (tmp_path / "cache" / CACHE_FOLDER).iterdir()
    entry.unlink()
    os.mkfifo(entry)
    report = _run(monkeypatch, capsys, recipe, tmp_path / "o2")
    assert report["dense"] == dense and any("ignored (it is not a regular file)" in n for n in report["notes"])
    assert entry.is_fifo()  # a planted FIFO is left alone, not replaced
    entry.unlink()
    entry.write_text(json.dumps({"identity": None, "metrics": {"wikitext2_ppl": float("nan")}}))
    report = _run(monkeypatch, capsys, recipe, tmp_path / "o3")
    assert report["dense"] == dense and any("measured again" in n for n in report["notes"])
    for item in (tmp_path / "cache" / CACHE_FOLDER).iterdir():
        item.unlink()
    (tmp_path / "cache" / CACHE_FOLDER).rmdir()
    (tmp_path / "cache" / CACHE_FOLDER).write_text("in the way")
    report = _run(monkeypatch, capsys, recipe, tmp_path / "o4")
    assert report["dense"] == dense and any("measured, not cached" in n for n in report["notes"])
    assert (tmp_path / "cache" / CACHE_FOLDER).read_text() == "in the way"


# --- class 4 and 6: the Python API -----------------------------------------------------------------------------


def test_api_evaluate_refuses_non_finite_weights(template, tmp_path):
    model, tokenizer = slimkit.load(nan_model(tmp_path, template))
    with pytest.raises(SlimkitError, match=r"^the model given: weight model\.layers\.1\.mlp\.up_proj\.weight holds"):
        slimkit.evaluate(model, tokenizer, seq_len=32, max_tokens=128)
    with pytest.raises(SlimkitError, match="holds NaN or inf"):
        slimkit.export(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("kind", [str, Path, os.fsencode])
def test_api_paths_may_be_str_pathlike_or_bytes(kind, template, tmp_path):
    recipe = recipe_file(tmp_path, template)
    assert slimkit.Recipe.from_yaml(kind(str(recipe))) == load_recipe(str(recipe))[0]
    model, tokenizer = slimkit.load(kind(str(template)))
    assert isinstance(model, torch.nn.Module) and tokenizer is not None
    loaded = slimkit.load_source(kind(str(template)))
    assert isinstance(loaded[0], torch.nn.Module)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda m, t, r: slimkit.evaluate(m, t, perplexity="wikitext2"), "perplexity: expected a list of strings"),
        (lambda m, t, r: slimkit.evaluate(m, t, zeroshot="piqa"), "zeroshot: expected a list of strings"),
        (lambda m, t, r: slimkit.Recipe.from_yaml(r, overrides="seed=3"), "overrides: expected a list of strings"),
        (lambda m, t, r: slimkit.run(r, overrides="seed=3"), "overrides: expected a list of strings"),
        (lambda m, t, r: slimkit.run(42), "recipe: expected a Recipe, a bundled recipe name, a YAML path"),
        (lambda m, t, r: slimkit.run(r, out=3.5), "out: expected a path (str, os.PathLike or bytes), got float"),
        (lambda m, t, r: slimkit.load(7), "directory: expected a path (str, os.PathLike or bytes), got int"),
        (lambda m, t, r: slimkit.Recipe.from_yaml(None), "name_or_file: expected a path"),
        (lambda m, t, r: slimkit.evaluate(m, t, perplexity=[1]), "a list holding a non-string"),
    ],
)
def test_api_refuses_wrong_argument_types_in_one_line(call, fragment, template, tmp_path):
    model, tokenizer = slimkit.load(template)
    recipe = str(recipe_file(tmp_path, template))
    before = tree_checksum(tmp_path)
    with pytest.raises(SlimkitError) as raised:
        call(model, tokenizer, recipe)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    assert tree_checksum(tmp_path) == before


@pytest.mark.slow
def test_api_run_takes_a_pathlib_recipe_and_a_bytes_out(template, tmp_path):
    result = slimkit.run(recipe_file(tmp_path, template), out=os.fsencode(str(tmp_path / "out")), evaluate=False)
    assert (tmp_path / "out" / "report.json").is_file() and result.report.recipe == "tiny-wanda"


# --- class 7: allocations that measure calibrate, whatever the scorer reads ---------------------------------


@pytest.mark.parametrize("allocation", [{"global": {"by": "refit_error"}}, {"search": {"max_evals": 2}}])
def test_an_allocation_that_measures_gets_calibration_with_a_random_scorer(allocation, tmp_path):
    recipe = tiny_recipe("unused")
    recipe["stages"] = [
        {"sequential": [{"stage": "prune_layer", "args": {"scorer": "random", "allocation": allocation}}]}
    ]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    parsed, _ = load_recipe(str(path))
    assert parsed.calibration_config() is not None
    recipe["stages"][0]["sequential"][0]["args"]["allocation"] = "uniform"
    path.write_text(yaml.safe_dump(recipe))
    assert load_recipe(str(path))[0].calibration_config() is None  # a random scorer alone reads no data


@pytest.mark.slow
def test_refit_error_allocation_with_a_random_scorer_runs(template, tmp_path, monkeypatch, capsys):
    recipe = tiny_recipe(template)
    recipe["stages"] = [
        {
            "sequential": [
                {"stage": "prune_layer", "args": {"scorer": "random", "allocation": {"global": {"by": "refit_error"}}}}
            ]
        }
    ]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _out, err = run_cli(
        monkeypatch, capsys, "recipe", "run", str(path), "--out", str(tmp_path / "o"), "--no-eval"
    )
    assert code == 0, err
