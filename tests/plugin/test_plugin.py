"""A stage from another installed package is usable by name: the test installs the tiny plugin package in
``tests/plugin/toy_plugin`` (with pip, into a folder put on ``PYTHONPATH``), runs a recipe naming its stage through
``slimkit recipe run``, finds it in ``slimkit stage list`` / ``show`` with the package it comes from and in ``slimkit
stage support``, and gets one error line for the plugin stage whose import fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

PLUGIN = Path(__file__).parent / "toy_plugin"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a slimkit process that sees the installed plugin."""
    work = tmp_path_factory.mktemp("plugin")
    source = work / "source"
    shutil.copytree(PLUGIN, source)  # pip builds in place: keep the test tree clean
    site = work / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "--target", str(site), str(source)], check=True, capture_output=True, text=True)
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}


def slimkit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimkit.cli.main", *args], capture_output=True, text=True, check=False, env=env
    )


def test_a_plugin_stage_runs_through_recipe_run(plugin_env, tiny_llama_dir, tmp_path):
    recipe = {
        "name": "plugin",
        "model": str(tiny_llama_dir),
        "target": {"ratio": 0.25, "of": "mlp"},  # 16 of the tiny Llama's 64 channels
        "stages": [{"stage": "keep_first_channels", "args": {"keep": 48}}],
        "eval": {"perplexity": None},
    }
    (tmp_path / "plugin.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    done = slimkit(plugin_env, "recipe", "run", str(tmp_path / "plugin.yaml"), "--out", str(out), "--no-dense")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["met"] and report["stages"]["keep_first_channels"]["kept"] == 48
    assert [w["intermediate_size"] for w in report["layers"]["after"]] == [48] * 3


def test_the_catalogue_names_the_plugins_package_and_its_broken_stage(plugin_env):
    listed = slimkit(plugin_env, "stage", "list")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if "keep_first_channels" in line)
    assert "package slimkit-toy-plugin 0.1.0" in row and "Keep the first" in row
    text = " ".join(listed.stdout.split())  # the terminal table wraps long lines
    assert "not loaded: stage 'needs_missing_library' (package slimkit-toy-plugin 0.1.0" in text
    assert "ModuleNotFoundError: No module named 'slimkit_toy_plugin_missing_library'" in text
    shown = slimkit(plugin_env, "stage", "show", "keep_first_channels")
    assert shown.returncode == 0 and "from: package slimkit-toy-plugin 0.1.0" in " ".join(shown.stdout.split())
    support = slimkit(plugin_env, "stage", "support")
    assert support.returncode == 0 and "keep_first_channels" in support.stdout


def test_a_recipe_naming_the_broken_plugin_stage_is_one_line(plugin_env, tiny_llama_dir, tmp_path):
    recipe = {"name": "broken", "model": str(tiny_llama_dir), "stages": [{"stage": "needs_missing_library"}]}
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(recipe))
    done = slimkit(plugin_env, "recipe", "validate", str(tmp_path / "broken.yaml"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: stage 'needs_missing_library' (package slimkit-toy-plugin")
    assert "its import failed: ModuleNotFoundError" in lines[0]
