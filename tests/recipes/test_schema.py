"""recipes/schema.py: how a recipe serialises (the checkpoint folder's hash reads this dump)."""

from __future__ import annotations

import warnings

from slimkit.recipes.schema import Recipe


def test_a_sequential_block_serialises_as_itself_without_warnings() -> None:
    recipe = Recipe.from_yaml("deploy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stages = recipe.model_dump(mode="json")["stages"]
    assert [child["stage"] for child in stages[0]["sequential"]] == ["prune_layer", "reconstruct"]
