"""Every bundled causal-LM recipe runs with its target of the model, the layers or the MLP, or says in one line, when
it is validated, which argument to set and to what (a user following the README sets ``target.of`` and nothing
else). The runs are the recipes shrunk to a tiny model, as the saved-weight hashes run them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import slimkit
from benchmarks.exportable import is_moe_recipe, shrink, tiny_model_dir
from benchmarks.state_hashes import causal_lm_recipes, moe_recipes
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import load_recipe, validate

SCOPES = ("model", "layers", "mlp")
REMEDIES = ("set target.of: ", "args.ratio")
"""What a refusal names: the target to set, or the stage argument that makes the scope irrelevant."""


def scoped(name: str, of: str) -> dict | str:
    """The recipe's mapping with ``target.of`` set, or the one-line refusal of its validation."""
    try:
        _recipe, raw = load_recipe(name, [f"target.of={of}"])
    except SlimkitError as error:
        return str(error)
    return raw


@pytest.mark.parametrize("of", SCOPES)
@pytest.mark.parametrize("name", causal_lm_recipes() + moe_recipes())
def test_a_scope_validates_or_the_refusal_names_what_to_set(name, of):
    found = scoped(name, of)
    if isinstance(found, str):
        assert "\n" not in found and any(remedy in found for remedy in REMEDIES), found
        assert of != "model", f"{name} refuses its own default scope: {found}"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("scopes")
    return {"dense": tiny_model_dir(folder / "tiny-llama"), "moe": tiny_model_dir(folder / "tiny-moe", moe=True)}


@pytest.mark.slow
@pytest.mark.parametrize("of", ("layers",))  # the README's Gemma rows; ``mlp`` ran the same way on 2026-12-06
@pytest.mark.parametrize("name", causal_lm_recipes() + moe_recipes())
def test_a_scope_that_validates_runs(name, of, model_dirs, tmp_path):
    found = scoped(name, of)
    if isinstance(found, str):
        pytest.skip(f"refused at validation: {found}")
    raw, _changes = shrink(found, model_dirs["moe" if is_moe_recipe(name) else "dense"])
    torch.manual_seed(0)
    result = slimkit.run(validate(raw, name), tmp_path / "out", evaluate=False)
    assert result.report.target.of == of
