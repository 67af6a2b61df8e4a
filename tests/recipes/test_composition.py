"""Composition: every pair of bundled stage kinds in sequence, on a tiny llama with grouped-query attention.

Each pair (A, B) is the recipe ``[A with its own explicit ratio, B deriving its share from the target]``
(before a stage that removes nothing, ``lora``, the first stage derives its share; a stage without an
explicit ratio derives it in both places). Every pair either validates and then lands within the
tolerance of the recipe's one target, or is refused at validation with a message that says why; nothing
fails after compute.
The tolerance is 2.5 points here, not the default 0.5: one hidden feature of the tiny model is ~2% of
its parameters, so ``pca_project``'s widths and ``mask_train``'s hidden gates cannot land closer (the
real model's hidden feature is 0.2%).
"""

from __future__ import annotations

import itertools

import pytest

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import validate

LORAP_FIRST = {
    "sequential": [
        {"stage": "lowrank", "args": {"method": "svd", "ratio": 0.2}},
        {"stage": "prune_layer", "args": {"scorer": "activation", "ratio": 0.1}},
    ]
}
LORAP_DERIVED = {
    "sequential": [
        {"stage": "lowrank", "args": {"method": "awsvd"}},
        {"stage": "prune_layer", "args": {"scorer": "activation", "protect_lowest": 0.01}},
    ]
}
CCE = {"kinds": ["mlp_channel"], "scorer": "magnitude", "iterations": 2}
MASKS = {"mask_steps": 3, "batch_size": 2, "seq_len": 16}

# name -> (the stage with an explicit share, the stage deriving its share)
KINDS: dict[str, tuple[dict, dict]] = {
    "prune": (
        {"stage": "prune", "args": {"groups": ["attention_head", "mlp_channel"], "scorer": "taylor", "ratio": 0.1}},
        {"stage": "prune", "args": {"groups": ["mlp_channel"], "scorer": {"blend": {"activation": 1, "taylor": 1}}}},
    ),
    "prune_layer": (
        {"sequential": [{"stage": "prune_layer", "args": {"ratio": 0.1}}]},
        {"sequential": [{"stage": "prune_layer", "args": {"scorer": {"platon": "activation"}}}]},
    ),
    "lorap": (LORAP_FIRST, LORAP_DERIVED),
    "cce": ({"stage": "cce", "args": {**CCE, "ratio": 0.1}}, {"stage": "cce", "args": CCE}),
    "prunenet": (
        {"stage": "prunenet", "args": {"episodes": 1, "ratio": 0.1, "save_policy": False}},
        {"stage": "prunenet", "args": {"episodes": 1, "save_policy": False}},
    ),
    "pca_project": (
        {"stage": "pca_project", "args": {"group_size": 2, "ratio": 0.0}},
        {"stage": "pca_project", "args": {"group_size": "all"}},
    ),
    "mask_train": ({"stage": "mask_train", "args": MASKS}, {"stage": "mask_train", "args": MASKS}),
    "lora": (
        {"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 16}},
        {"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 16}},
    ),
}
# Refusals a pair may get at validation, by the reason's text.
REFUSALS = (
    "derives its share from the target",
    "both solve the rest",
    "low-rank pairs",
    "no stage removes",
    "once per recipe",
)


def _recipe(model_dir, first: dict, second: dict) -> dict:
    return {
        "name": "pair",
        "model": str(model_dir),
        "seed": 0,
        "calibration": {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2},
        "target": {"ratio": 0.2, "of": "model", "tolerance": 0.025},
        "stages": [first, second],
        "eval": {"perplexity": None},
    }


PAIRS = list(itertools.product(KINDS, KINDS))


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a}-then-{b}" for a, b in PAIRS])
def test_stage_pair_validates_and_lands_on_target_or_is_refused(tiny_llama_dir, first, second):
    # Before a stage that removes nothing, the first stage derives its share itself.
    raw = _recipe(tiny_llama_dir, KINDS[first][1 if second == "lora" else 0], KINDS[second][1])
    try:
        recipe = validate(raw, "pair")
    except SlimkitError as error:
        assert any(reason in str(error) for reason in REFUSALS), str(error)
        assert "\n" not in str(error)
        return
    result = slimkit.run(recipe, evaluate=False)  # raises when the target is missed (strict)
    target = result.report.as_json()["target"]
    assert target["met"] and abs(target["achieved"] - 0.2) <= 0.025
    assert sum(target["shares"].values()) == pytest.approx(target["achieved"])


def test_a_missed_target_fails_with_the_stages_shares(tiny_llama_dir, tmp_path):
    raw = _recipe(tiny_llama_dir, KINDS["prune"][0], KINDS["lora"][1])  # 10% of units, then no removal
    with pytest.raises(SlimkitError, match=r"target missed: 20.0% of model wanted, .* removed by stage: 0:prune"):
        slimkit.run(validate(raw, "r"), out=tmp_path / "out", evaluate=False)
    assert not (tmp_path / "out").exists()
    raw["target"]["strict"] = False
    result = slimkit.run(validate(raw, "r"), evaluate=False)
    assert result.report.as_json()["target"]["met"] is False
    assert any(note.startswith("target not met") for note in result.report.as_json()["notes"])


def test_a_stage_after_the_solver_is_refused_at_validation(tiny_llama_dir):
    raw = _recipe(tiny_llama_dir, KINDS["cce"][1], KINDS["prune"][1])
    with pytest.raises(SlimkitError, match=r"stages.1: stage 'prune' derives its share .* stages.0 \('cce'\)"):
        validate(raw, "r")


def test_lowrank_then_attention_pruning_is_refused_at_validation(tiny_llama_dir):
    prune_heads = {"stage": "prune", "args": {"groups": ["attention_head"], "ratio": 0.1}}
    raw = _recipe(tiny_llama_dir, LORAP_FIRST, prune_heads)
    with pytest.raises(SlimkitError, match=r"stages.1: stage 'prune' needs plain Linear k, o, q, v projections"):
        validate(raw, "r")


def test_reconstruct_after_an_obs_update_in_its_block_is_refused_at_validation(tiny_llama_dir):
    """OBS rewrites down's kept columns; reconstruct matches them to the dense ones, so the pair fails before any
    compute (it used to fail at the first layer, after the block's pre-pass); refitting only o is allowed."""
    block = {
        "sequential": [
            {"stage": "obs_prune_layer", "args": {"groups": ["mlp_channel"]}},
            {"stage": "reconstruct", "args": {}},
        ]
    }
    raw = _recipe(tiny_llama_dir, block, {"stage": "lora", "args": {"steps": 0}})
    raw["stages"] = raw["stages"][:1]
    with pytest.raises(
        SlimkitError,
        match=r"stages.0.sequential.1: stage 'reconstruct' refits down from the dense weights, but "
        r"stages.0.sequential.0 \('obs_prune_layer'\) already rewrote its kept columns",
    ):
        validate(raw, "r")
    block["sequential"][1]["args"] = {"roles": ["o"]}
    validate(raw, "r")


def test_coupled_scores_after_lowrank_read_only_the_mlp(tiny_llama_dir):
    """CCE's coupled scorer on MLP channels after the attention became low-rank (its LoRA gradient proxy
    needs plain Linear weights, and only the MLP's are read)."""
    cce = {"stage": "cce", "args": {"kinds": ["mlp_channel"], "gradients": "lora", "iterations": 2, "lora_steps": 1}}
    lowrank = {"sequential": [{"stage": "lowrank", "args": {"method": "awsvd", "ratio": 0.3}}]}
    result = slimkit.run(validate(_recipe(tiny_llama_dir, lowrank, cce), "r"), evaluate=False)
    target = result.report.as_json()["target"]
    assert target["met"] and result.report.as_json()["stages"]["cce"]["scorer"] == "coupled"
    assert list(target["shares"]) == ["0:sequential[lowrank]", "1:cce"] and all(
        v > 0 for v in target["shares"].values()
    )
