"""``slimkit compress`` and ``slimkit.compress``: budgets checked before any compute (one ``error:`` line, exit 2,
nothing written), the recipe they make, and a run on the tiny llama with a comparison."""

from __future__ import annotations

import json

import pytest

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.compress import (
    CompressSettings,
    compare_recipe,
    comparison_markdown,
    comparison_rows,
    compress_recipe,
)
from slimkit.recipes.loading import validate
from tests.cli.test_cli import assert_one_line_error, run_cli


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "give a budget: params (fraction kept), memory (e.g. 2GiB) or speedup"),
        (["--params", "1.2"], "compress: params: Input should be less than 1"),
        (["--params", "0"], "compress: params: Input should be greater than 0"),
        (["--memory", "lots"], "compress: memory: expected a size like 20GiB"),
        (["--speedup", "0.9"], "compress: speedup: Input should be greater than 1"),
        (["--speedup", "2", "--runtime", "tvm"], "unknown --runtime 'tvm'; allowed: llama.cpp, pytorch"),
        (["--runtime", "pytorch", "--params", "0.8"], "--runtime says where --speedup is measured"),
        (["--params", "0.8", "--compare", "qualiti"], "unknown bundled recipe 'qualiti'; did you mean 'quality'?"),
        (["--params", "0.8", "--time-limit", "-1"], "compress: time_limit: Input should be greater than 0"),
        (["--params", "0.8", "--uniform", "ffn"], "compress: uniform.0: Input should be 'attention' or 'mlp'"),
    ],
)
def test_bad_budgets_are_one_line_before_any_compute(monkeypatch, capsys, tmp_path, args, fragment):
    code, _out, err = run_cli(monkeypatch, capsys, "compress", "smollm2-135m", "--out", str(tmp_path / "o"), *args)
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "o").exists()


def test_a_missing_model_is_one_line(monkeypatch, capsys, tmp_path):
    code, _out, err = run_cli(monkeypatch, capsys, "compress", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                              "--params", "0.8")  # fmt: skip
    assert_one_line_error(code, err, "does not exist")
    assert not (tmp_path / "o").exists()


def test_the_recipe_carries_the_budgets():
    settings = CompressSettings(params=0.8, memory="2GiB", context=512, speedup=1.3, uniform=["mlp"])
    raw = compress_recipe("smollm2-135m", settings)
    assert raw["target"] == {"ratio": 0.2, "of": "model"}
    args = raw["stages"][0]["args"]
    assert args["uniform"] == ["mlp"]
    assert args["memory_budget"] == {"limit": "2GiB", "context": 512, "batch": 1}
    assert args["latency_budget"] == {"speedup": 1.3, "runtime": "llama.cpp"}
    validate(raw, "compress")
    memory_only = compress_recipe("smollm2-135m", CompressSettings(memory="100MB"))
    assert memory_only["target"] == {"ratio": 0.0, "of": "model", "tolerance": 1.0}
    validate(memory_only, "compress")
    compared = compare_recipe("deploy", raw, 0.1873)
    assert compared["target"]["ratio"] == 0.1873 and compared["eval"] == raw["eval"]
    assert compared["model"] == "smollm2-135m" and compared["seed"] == raw["seed"]


def test_the_comparison_table():
    reports = {
        "search": {"params": {"after": 100}, "target": {"achieved": 0.2}, "metrics": {"wikitext2_ppl": 40.0}},
        "deploy": {"params": {"after": 101}, "target": {"achieved": 0.199}, "metrics": {"wikitext2_ppl": 50.5}},
    }
    rows = comparison_rows(reports)
    assert rows[1] == {"recipe": "deploy", "params": 101, "ratio": 0.199, "wikitext2_ppl": 50.5}
    assert comparison_markdown(rows).splitlines()[2:] == [
        "| search | 100 | 20.0% | 40.00 |",
        "| deploy | 101 | 19.9% | 50.50 |",
    ]


@pytest.mark.slow
def test_compress_writes_the_run_its_recipe_and_the_comparison(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    result = slimkit.compress(
        str(tiny_llama_dir), out, params=0.85, compare=["wanda-channels+reconstruct"], evaluate=False
    )
    assert result.search.report.target.met
    assert {row["recipe"] for row in result.rows} == {"search", "wanda-channels+reconstruct"}
    assert (out / "search" / "recipe.yaml").is_file() and (out / "search" / "scores.png").is_file()
    assert json.loads((out / "compare.json").read_text()) == result.rows
    marker = json.loads((out / ".slimkit-run.json").read_text())
    assert "compare.md" in marker["files"] and "compare.json" in marker["files"]
    again = slimkit.compress(str(tiny_llama_dir), out, params=0.8, force=True, evaluate=False)  # --force replaces it
    assert again.search.report.target.met and not (out / "compare.md").exists()
    with pytest.raises(SlimkitError, match="compress: compare: each recipe once"):
        slimkit.compress(str(tiny_llama_dir), params=0.8, compare=["deploy", "deploy"])
