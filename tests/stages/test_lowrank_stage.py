"""The `lowrank` stage and LoRAP-style recipes on a tiny model: budgets, save/load of low-rank pairs."""

from __future__ import annotations

import json

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.recipes.loading import validate
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import tiny_llama


def lorap_recipe(model_dir, **lowrank_args):
    stages = [
        {
            "sequential": [
                {"stage": "lowrank", "args": {"mac_fraction": 1.0, **lowrank_args}},
                {
                    "stage": "prune_layer",
                    "args": {"groups": ["mlp_channel"], "protect_lowest": 0.01, "ratio_rule": "layer"},
                },
            ]
        }
    ]
    return tiny_recipe(model_dir, target={"ratio": 0.2, "of": "model", "strict": False}, stages=stages)


def test_lorap_style_run_saves_and_reloads_low_rank_pairs(tmp_path, tiny_llama_dir):
    raw = lorap_recipe(tiny_llama_dir)
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    fraction = report["stages"]["lowrank"]["fraction"]
    assert fraction == report["stages"]["prune_layer"]["unit_fraction"]
    ranks = report["stages"]["lowrank"]["ranks"]["0"]
    assert set(ranks) == {"q", "k", "v", "o"} and ranks["q"] is not None
    model, _tok = slimkit.load(tmp_path / "run" / "model")
    assert isinstance(ModelView(model).layer(0).linear("q"), LowRankLinear)
    manifest = json.loads((tmp_path / "run" / "model" / "slimkit_manifest.json").read_text())
    assert {m["kind"] for m in manifest["modules"]} == {"low_rank"}
    assert report["params"]["after"] == sum(p.numel() for p in model.parameters())
    again = slimkit.load(tmp_path / "run" / "model")[0]
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)


def test_layer_ratio_hand_case(tmp_path, tiny_llama_dir):
    # tiny llama with the 259-token byte vocabulary: embeddings 259 x 48 = 12,432, three layers of
    # attention 6,144 + mlp 9,216 + norms 96, final norm 48: total 58,848;
    # Ratio_l = 58,848 x 0.2 / (3 x 15,360) = 0.255416...
    raw = lorap_recipe(tiny_llama_dir)
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    assert report["stages"]["lowrank"]["fraction"] == pytest.approx(58_848 * 0.2 / (3 * 15_360))


def test_uniform_allocation_of_mlp_projections(tmp_path, tiny_llama_dir):
    stages = [
        {
            "sequential": [
                {
                    "stage": "lowrank",
                    "args": {
                        "roles": ["up", "down"],
                        "allocation": "uniform",
                        "method": "svd",
                        "ratio": 0.5,
                        "mac_fraction": 1.0,
                    },
                }
            ]
        }
    ]
    raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0.2, "of": "model", "strict": False}, stages=stages)
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    # up: 48 -> 64, dense 3,072, half = 1,536 -> rank floor(1,536 / 112) = 13
    assert report["stages"]["lowrank"]["ranks"]["2"] == {"up": 13, "down": 13}


def test_lorap_allocation_needs_attention_roles(tmp_path):
    bad = tiny_recipe(tmp_path, stages=[{"stage": "lowrank", "args": {"roles": ["up"]}}])
    with pytest.raises(SlimkitError, match="allocation: lorap splits the attention budget"):
        validate(bad, "r.yaml")


def global_recipe(model_dir, lowrank_args: dict, mlp_allocation="uniform"):
    stages = [
        {
            "sequential": [
                {"stage": "lowrank", "args": {"mac_fraction": 1.0, "allocation": {"global": {}}, **lowrank_args}},
                {"stage": "prune_layer", "args": {"groups": ["mlp_channel"], "allocation": mlp_allocation}},
            ]
        }
    ]
    return tiny_recipe(model_dir, target={"ratio": 0.2, "of": "model"}, stages=stages)


def test_global_rank_allocation_shares_the_lorap_total_and_the_block_lands_on_the_target(tmp_path, tiny_llama_dir):
    raw = global_recipe(tiny_llama_dir, {}, mlp_allocation={"global": {}})
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    assert report["target"]["met"]
    lowrank = report["stages"]["lowrank"]
    allocation = lowrank["allocation"]
    # LoRAP's layer ratio of the four attention matrices of all three layers: 0.2554 x 3 x 6,144 = 4,708
    assert allocation["wanted"] == int(58_848 * 0.2 / (3 * 15_360) * 3 * 6_144)
    assert allocation["wanted"] - 96 <= allocation["removed"] <= allocation["wanted"]  # within one rank of q
    ranks = [rank for layer in lowrank["ranks"].values() for rank in layer.values()]
    assert len(set(ranks)) > 1  # not one rank for all
    saved = sum(
        dense - (rank * (48 + out) if rank is not None else dense)
        for layer in lowrank["ranks"].values()
        for role, rank in layer.items()
        for out, dense in [(48 if role in ("q", "o") else 16, 48 * (48 if role in ("q", "o") else 16))]
    )
    assert saved == allocation["removed"]  # the ranks the layers took are the ones the pre-pass planned
    model, _tok = slimkit.load(tmp_path / "run" / "model")
    assert report["params"]["after"] == sum(p.numel() for p in model.parameters())


def test_a_matrix_of_rank_one_gets_the_lowest_rank(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        q = model.model.layers[1].self_attn.q_proj.weight
        q.copy_(torch.outer(torch.randn(q.shape[0]), torch.randn(q.shape[1])))  # rank one: nothing lost at rank 1
    raw = global_recipe("unused", {"roles": ["q", "o"], "method": "svd"})
    report = slimkit.run(raw, model=model, tokenizer=tokenizer, evaluate=False).report.as_json()
    ranks = report["stages"]["lowrank"]["ranks"]
    assert ranks["1"]["q"] == 1
    assert all(ranks[str(i)]["q"] != 1 for i in (0, 2))


@pytest.mark.parametrize(
    ("allocation", "message"),
    [
        ({"search": {}}, "a search over ranks is not available for lowrank"),
        ("search", "a search over ranks is not available for lowrank"),
        ("evenly", "unknown allocation 'evenly'"),
        ({"global": {"max_fraction": 0}}, "max_fraction"),
    ],
)
def test_an_allocation_lowrank_cannot_take_is_refused(tmp_path, allocation, message):
    bad = tiny_recipe(tmp_path, stages=[{"stage": "lowrank", "args": {"allocation": allocation}}])
    with pytest.raises(SlimkitError, match=message):
        validate(bad, "r.yaml")


def test_a_share_the_matrices_cannot_save_is_refused_before_calibration(tokenizer, monkeypatch):
    from slimkit.engine import runner

    def no_calibration(ctx):
        raise AssertionError("calibrated before the refusal")

    monkeypatch.setattr(runner, "_calibrate", no_calibration)
    # q and o (48 x 48) may lose at most 30% each: rank >= 17 saves 2,304 - 17 x 96 = 672 of 2,304 apiece
    raw = global_recipe("unused", {"roles": ["q", "o"], "ratio": 0.5, "allocation": {"global": {"max_fraction": 0.3}}})
    with pytest.raises(SlimkitError) as refused:
        slimkit.run(raw, model=tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer, evaluate=False)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("lowrank (allocation global): the matrices save at most 4,032 parameters")
    assert "6,912 wanted" in message and "raise max_fraction" in message


def test_lora_after_a_global_rank_allocation_adapts_dense_and_low_rank_layers_of_one_name(tokenizer):
    torch.manual_seed(0)
    raw = global_recipe("unused", {})
    raw["stages"].append({"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 32, "dataset": "alpaca"}})
    report = slimkit.run(raw, model=tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer, evaluate=False)
    ranks = report.report.stages["lowrank"].details["ranks"]
    assert {ranks[str(i)]["q"] is None for i in range(3)} == {True, False}  # q dense in some layers only
    assert len(report.report.stages["lora"].details["losses"]) == 1


def test_the_rank_and_channel_allocations_share_one_dense_pass(tokenizer, monkeypatch):
    from slimkit.engine import allocation_prepass as allocation

    passes = []
    real = allocation.dense_layer_statistics

    def counted(*args, **kwargs):
        passes.append(args[2])  # the roles the pass gathers Grams for
        yield from real(*args, **kwargs)

    monkeypatch.setattr(allocation, "dense_layer_statistics", counted)
    torch.manual_seed(0)
    raw = global_recipe("unused", {}, mlp_allocation={"global": {}})
    result = slimkit.run(raw, model=tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer, evaluate=False)
    assert len(passes) == 1
    assert result.report.target.met
    stages = result.report.stages
    assert (
        stages["lowrank"].details["allocation"]["score_seconds"]
        == stages["prune_layer"].details["allocation"]["score_seconds"]
    )


def test_roles_the_architecture_lacks_are_refused_after_loading():
    from slimkit.primitives.errors import SlimkitError as Refusal
    from slimkit.recipes.catalogue import stage_def
    from tests.tiny import tiny_opt

    args = stage_def("lowrank").args.model_validate({"roles": ["gate", "up", "down"], "allocation": "uniform"})
    with pytest.raises(Refusal, match=r"^lowrank: roles gate: opt layers have no such projection"):
        args.check_model(tiny_opt())
