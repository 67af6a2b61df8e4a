"""Behaviour unchanged: every bundled causal-LM recipe, shrunk to a tiny random Llama, saves the same weights as when
``tests/contracts/state_hashes.json`` was recorded (``python -m benchmarks.state_hashes --write
tests/contracts/state_hashes.json`` on the tree before a behaviour-preserving change). The hashes depend on the torch
and transformers versions they were recorded with; under others the check is skipped, naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.exportable import is_moe_recipe, tiny_model_dir
from benchmarks.state_hashes import RECORD, causal_lm_recipes, moe_recipes, recipe_hash, versions

RECORDED = json.loads(RECORD.read_text())
FAST = ("wanda-channels", "lorap")
"""Recipes the fast tier checks (a pruning block and a low-rank block with LoRA); the rest are slow."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("state-hashes") / "tiny-llama")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("state-hashes") / "tiny-qwen3-moe", moe=True)


def test_every_causal_lm_recipe_is_recorded():
    assert sorted(RECORDED["hashes"]) == sorted(causal_lm_recipes() + moe_recipes())


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in sorted(RECORDED["hashes"])]
)
def test_saved_state_is_unchanged(name, model_dir, moe_dir, tmp_path):
    if versions() != RECORDED["versions"]:
        pytest.skip(f"hashes recorded with {RECORDED['versions']}, running {versions()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = moe_dir if is_moe_recipe(name) else model_dir
        assert recipe_hash(name, folder, tmp_path) == RECORDED["hashes"][name]
    finally:
        torch.set_num_threads(threads)
