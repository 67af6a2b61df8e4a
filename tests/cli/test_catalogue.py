"""The stage catalogue: ``slimkit stage list|show`` and the argument descriptions it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Literal

import pytest
from pydantic import Field, ValidationError

from slimkit.cli.main import _default_text, _reflow, _type_name
from slimkit.primitives.settings import Strict
from slimkit.recipes.catalogue import stage_def, stage_names

STAGES = stage_names()


def slimkit(*args: str, columns: int = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "slimkit.cli.main", *args], capture_output=True, text=True, check=False, env=env
    )


class Documented(Strict):
    width: int = Field(4, ge=1)
    """Units kept."""
    mode: Literal["a", "b"] = "a"


def test_attribute_docstrings_become_descriptions_with_extra_forbid():
    assert Documented.model_fields["width"].description == "Units kept."
    assert Documented.model_fields["mode"].description is None
    with pytest.raises(ValidationError, match="unknown field 'widht'; did you mean 'width'"):
        Documented.model_validate({"widht": 2})


@pytest.mark.parametrize("name", STAGES)
def test_every_stage_argument_has_a_description(name):
    # prune, prune_layer, lowrank and cce are documented by their owner; the test covers them too.
    args = stage_def(name).args
    missing = [field for field, info in args.model_fields.items() if not (info.description or "").strip()]
    assert not missing, f"{name}: arguments without a description: {missing}"


def test_type_names_read_like_recipes():
    assert _type_name(Literal["a", "b"]) == "a | b"
    assert _type_name(int | None) == "int | None"
    assert _type_name(int | Literal["all"]) == "int | all"
    assert _type_name(list[Literal["q", "k"]]) == "list[q | k]"
    assert _type_name(dict[str, int]) == "dict[str, int]"
    assert _type_name(bool) == "bool"


def test_defaults_read_like_yaml():
    fields = Documented.model_fields
    assert _default_text(fields["width"]) == "4"
    assert _default_text(fields["mode"]) == "a"

    class Other(Strict):
        ratio: float | None = None
        flag: bool = True
        kinds: list[str] = Field(default_factory=lambda: ["mlp_channel"])
        needed: int

    fields = Other.model_fields
    assert [_default_text(fields[n]) for n in ("ratio", "flag", "kinds", "needed")] == [
        "null",
        "true",
        "[mlp_channel]",
        "required",
    ]


def test_reflow_joins_paragraph_lines_and_keeps_items():
    text = "One line\ncontinued.\n\n* item one\n  more\n* item two\n\n    L = a + b\n    M = c"
    assert _reflow(text) == ["One line continued.", "* item one more\n* item two", "    L = a + b\n    M = c"]


@pytest.mark.slow
def test_stage_list_lists_every_stage():
    result = slimkit("stage", "list")
    assert result.returncode == 0, result.stderr
    for name in STAGES:
        assert f" {name} " in result.stdout, name
    assert " layer " in result.stdout and " model " in result.stdout


@pytest.mark.slow
def test_stage_show_prune_lists_its_arguments():
    result = slimkit("stage", "show", "prune", columns=250)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"prune: {stage_def('prune').summary}")
    assert "scope: model" in out and "calibration data: " in out
    for field in stage_def("prune").args.model_fields:
        assert f" {field} " in out, field
    assert "ratio" in out and "float | None, >= 0, < 1" in out


@pytest.mark.slow
def test_stage_show_narrow_terminal_still_lists_arguments():
    result = slimkit("stage", "show", "lora", columns=80)
    assert result.returncode == 0, result.stderr
    for field in stage_def("lora").args.model_fields:
        assert field in result.stdout, field


@pytest.mark.slow
def test_stage_show_calibration_follows_the_arguments():
    out = slimkit("stage", "show", "pca_project").stdout
    assert "calibration data: yes\n" in out
    out = slimkit("stage", "show", "lora").stdout
    assert "calibration data: no\n" in out


@pytest.mark.slow
def test_stage_show_unknown_name_suggests():
    result = slimkit("stage", "show", "prnue")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("error: unknown stage 'prnue'; did you mean 'prune'? allowed: ")
