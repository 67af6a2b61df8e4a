"""CLI usage errors (one ``error:`` line, exit status 2, no traceback) and the "did you mean" helpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from slimkit.primitives.errors import SlimkitError, closest, did_you_mean, unknown


def slimkit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "slimkit.cli.main", *args], capture_output=True, text=True, check=False, env=env
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single non-empty stderr line of a usage error (exit status 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- the helpers -------------------------------------------------------------------------------------


def test_did_you_mean_close_names():
    assert did_you_mean("prnue", ["lora", "prune", "prune_layer"]) == "; did you mean 'prune'?"
    assert did_you_mean("rnu", ["list", "show", "validate", "run"]) == "; did you mean 'run'?"
    # "ab" against "abcd": ratio 2 * 2 / (2 + 4) = 0.67 >= 0.6; against "abcdef": 4 / 8 = 0.5 < 0.6.
    assert did_you_mean("ab", ["abcd"]) == "; did you mean 'abcd'?"
    assert did_you_mean("ab", ["abcdef"]) == ""


def test_did_you_mean_no_match_case_and_self():
    assert did_you_mean("heads", ["lora", "prune"]) == ""
    assert did_you_mean("x", []) == ""
    assert did_you_mean("PRUNE", ["lora", "prune"]) == "; did you mean 'prune'?"  # case-insensitive
    assert did_you_mean("prune", ["prune"]) == ""  # never the name itself
    assert closest("wikitext", ["wikitext2", "ptb", "c4"]) == "wikitext2"
    assert closest("zzz", ["wikitext2", "ptb", "c4"]) is None


def test_unknown_message():
    assert (
        unknown("stage", "prnue", ["lora", "prune"])
        == "unknown stage 'prnue'; did you mean 'prune'? allowed: lora, prune"
    )
    assert unknown("stage", "heads", ["lora", "prune"]) == "unknown stage 'heads'; allowed: lora, prune"
    assert (
        unknown("model source", "gpt-5", ["smollm2-135m"], label="known", tail=", or a local model folder")
        == "unknown model source 'gpt-5'; known: smollm2-135m, or a local model folder"
    )
    assert unknown("dataset", "glue-qnli", ["glue", "glue-sst2"], suggest=["glue-sst2"]) == (
        "unknown dataset 'glue-qnli'; allowed: glue, glue-sst2"
    )
    assert unknown("field", "stag", {"stage": 1, "args": 2}) == (
        "unknown field 'stag'; did you mean 'stage'? allowed: stage, args"
    )


def test_unknown_names_in_recipes_suggest_the_closest():
    from slimkit.primitives.evaluate.eval_settings import check_corpus, check_glue_task, check_zeroshot_task
    from slimkit.recipes.loading import recipe_path
    from slimkit.recipes.schema import StageSpec, check_calibration_dataset

    with pytest.raises(ValidationError, match=r"unknown stage 'prnue'; did you mean 'prune'\? allowed: "):
        StageSpec.model_validate({"stage": "prnue"})
    with pytest.raises(ValidationError, match=r"unknown field 'stag'; did you mean 'stage'\? allowed: stage, args"):
        StageSpec.model_validate({"stag": "prune"})
    with pytest.raises(ValueError, match=r"unknown dataset 'wikitext'; did you mean 'wikitext2'\? allowed: "):
        check_corpus("wikitext")
    with pytest.raises(ValueError, match=r"unknown zero-shot task 'piqq'; did you mean 'piqa'\?"):
        check_zeroshot_task("piqq")
    with pytest.raises(ValueError, match=r"unknown dataset 'glue-sst'; did you mean 'glue-sst2'\? allowed: "):
        check_calibration_dataset("glue-sst")
    with pytest.raises(ValueError, match=r"unknown dataset 'glue-qnli'; allowed: "):  # not the bare 'glue'
        check_calibration_dataset("glue-qnli")
    with pytest.raises(ValueError, match=r"unknown GLUE task 'sst'; did you mean 'sst2'\? allowed: "):
        check_glue_task("sst")
    with pytest.raises(
        SlimkitError, match=r"unknown recipe 'wanda-chanels'; did you mean 'wanda-channels'\? bundled: "
    ):
        recipe_path("wanda-chanels")


def test_unknown_model_source_suggests_the_closest():
    from slimkit.primitives.io.model_sources import resolve_source

    with pytest.raises(
        SlimkitError, match=r"unknown model source 'smollm2-135'; did you mean 'smollm2-135m'\? known: "
    ):
        resolve_source("smollm2-135")


# --- the command line --------------------------------------------------------------------------------


def test_unknown_option_names_it_and_the_command():
    line = one_error_line(slimkit("recipe", "run", "lorap", "--out", "o", "--bogus"))
    assert line == "error: no such option '--bogus' for 'slimkit recipe run'"
    line = one_error_line(slimkit("recipe", "run", "lorap", "--out", "o", "--froce"))
    assert line == "error: no such option '--froce' for 'slimkit recipe run'; did you mean '--force'?"


def test_typod_subcommand_suggests_the_command():
    assert one_error_line(slimkit("recipe", "rnu")) == "error: no such command 'rnu'; did you mean 'run'?"
    assert one_error_line(slimkit("evl")) == "error: no such command 'evl'; did you mean 'eval'?"
    line = one_error_line(slimkit("zzzz"))
    assert line.startswith("error: no such command 'zzzz'; commands of 'slimkit': ") and "recipe" in line


def test_missing_option_and_argument():
    assert one_error_line(slimkit("recipe", "run", "lorap")) == "error: missing option '--out' for 'slimkit recipe run'"
    assert one_error_line(slimkit("recipe", "show")) == "error: missing argument 'NAME' for 'slimkit recipe show'"


def test_bad_option_value():
    line = one_error_line(slimkit("eval", "smollm2-135m", "--seq-len", "abc"))
    assert line.startswith("error: invalid value for option '--seq-len' of 'slimkit eval': ")


@pytest.mark.parametrize("args", [(), ("recipe",), ("stage",)])
def test_bare_group_prints_help_and_exits_2(args):
    result = slimkit(*args)
    assert result.returncode == 2
    assert "Usage:" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "error:" not in result.stderr


@pytest.mark.parametrize("args", [("--help",), ("recipe", "--help"), ("recipe", "run", "--help"), ("stage", "--help")])
def test_help_exits_0(args):
    result = slimkit(*args)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout


@pytest.mark.slow
def test_input_errors_keep_their_one_line():
    line = one_error_line(slimkit("recipe", "validate", "wanda-chanels"))
    assert line.startswith("error: unknown recipe 'wanda-chanels'; did you mean 'wanda-channels'? bundled: ")
