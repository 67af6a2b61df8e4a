"""Bad ``remove_blocks`` input: one ``error:`` line, exit status 2, nothing written, before calibration."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimkit.engine import runner
from tests.cli.test_cli import assert_one_line_error, run_cli, write_recipe
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import byte_tokenizer, tiny_opt


def _opt_dir(tmp_path: Path) -> Path:
    path = tmp_path / "opt"
    tiny_opt().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


CASES = {
    "count beyond the eligible blocks": ({"count": 7}, "count 7 is more than the 4 attention and mlp blocks"),
    "every attention block": ({"kinds": ["attention"], "count": 3}, "count 3 is more than the 2 attention blocks"),
    "skips leave no layer": ({"skip_first": 2, "skip_last": 1}, "leave none of 3 layers"),
    "an unknown kind": ({"kinds": ["experts"]}, "args.kinds.0"),
    "count and ratio": ({"count": 1, "ratio": 0.1}, "count and ratio: give one of them"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_remove_blocks_input_is_one_line_before_calibration(case, tmp_path, tiny_llama_dir, monkeypatch, capsys):
    args, fragment = CASES[case]
    _check(tmp_path, tiny_llama_dir, args, fragment, monkeypatch, capsys)


def test_an_architecture_without_removable_blocks_is_one_line_before_calibration(tmp_path, monkeypatch, capsys):
    fragment = "whole-block removal is not supported for opt: opt layers hold their MLP projections directly"
    _check(tmp_path, _opt_dir(tmp_path), {"count": 1}, fragment, monkeypatch, capsys)


def _check(tmp_path: Path, model_dir: Path, args: dict, fragment: str, monkeypatch, capsys) -> None:
    def no_calibration(*_args, **_kwargs):
        raise AssertionError("calibrated before the refusal")

    monkeypatch.setattr(runner, "calibration_batches", no_calibration)
    stages = [{"stage": "remove_blocks", "args": args}]
    recipe = tiny_recipe(model_dir, target={"ratio": 0.2, "of": "model"}, stages=stages)
    file = write_recipe(tmp_path / "recipe.yaml", recipe)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _out, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
