"""The `obs_prune_layer` stage (greedy structured OBS selection + update) and the `obs` scorer."""

from __future__ import annotations

import math

import pytest
import torch

import slimkit
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.importance import score_group
from slimkit.primitives.reconstruct import gram_hooks, inverse_hessian, obs_prune, refit_least_squares
from slimkit.primitives.reconstruct.consumer import DenseConsumer
from slimkit.recipes.loading import load_recipe, validate
from slimkit.stages.obs_prune import ObsPruneLayer, ObsPruneLayerArgs
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import model_output, tiny_llama


def obs_prune_layer(ctx: Context, args: ObsPruneLayerArgs, layer, stats: LayerStats) -> dict:
    """The stage on one layer, outside a recipe; its report entry."""
    stage = ObsPruneLayer()
    state = stage.start(ctx, args)
    stage.run_layer(state, layer, stats)
    return dict(stage.finish(state).details)


def _context(model: torch.nn.Module, tokenizer) -> Context:
    recipe = slimkit.Recipe(**tiny_recipe("unused", target={"ratio": 0.2, "of": "layers"}))
    return Context(recipe=recipe, model=model, tokenizer=tokenizer, source={}, generator=torch.Generator())


def _stats(model: torch.nn.Module, index: int, roles: list[str]) -> LayerStats:
    """``dense_consumers`` of layer ``index`` from a forward pass on 128 random tokens."""
    layer = ModelView(model).layer(index)
    consumers = {role: layer.linear(role) for role in roles}
    with gram_hooks(consumers) as grams, torch.no_grad():
        model(torch.randint(3, 250, (2, 64), generator=torch.Generator().manual_seed(1)))
    return LayerStats(
        dense_consumers={
            role: DenseConsumer(module.weight.detach().clone(), grams[role].gram) for role, module in consumers.items()
        }
    )


def _duplicate_channel(model: torch.nn.Module, index: int, source: int, copy: int) -> None:
    """Make MLP channel ``copy`` of layer ``index`` compute exactly what channel ``source`` computes."""
    layer = ModelView(model).layer(index)
    with torch.no_grad():
        for role in ("gate", "up"):
            layer.linear(role).weight[copy] = layer.linear(role).weight[source]


def test_a_duplicated_channel_is_removed_first_and_the_output_is_unchanged(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    _duplicate_channel(model, 0, source=3, copy=5)  # activation 5 = activation 3: a linear combination
    ids = torch.randint(3, 250, (2, 17))
    before = model_output(model, ids)
    stats = _stats(model, 0, ["down"])
    ctx = _context(model, tokenizer)
    args = ObsPruneLayerArgs(groups=["mlp_channel"], ratio=1 / 64, damping=1e-9)
    result = obs_prune_layer(ctx, args, ctx.view.layer(0), stats)["layers"]["down"]["0"]
    assert result["kept"] == 63 and result["removed"] in ([3], [5])
    assert result["error"] < 1e-9 < 1e-2 < result["error_unrefit"]  # without the update the output changes
    assert ctx.view.layer(0).linear("down").weight.shape == (48, 63)
    assert ctx.view.layer(0).linear("gate").weight.shape == (63, 48)
    torch.testing.assert_close(model_output(model, ids), before, rtol=1e-4, atol=1e-5)


def test_the_obs_scorer_gives_the_duplicated_channels_zero_cost(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    _duplicate_channel(model, 1, source=3, copy=5)
    stats = _stats(model, 1, ["down"])
    group = build_groups(model, "mlp_channel", [1])[0]
    scores = score_group("obs", group, model, stats)
    weight = ModelView(model).layer(1).linear("down").weight.detach().double()
    hinv, _ = inverse_hessian(stats["dense_consumers"]["down"].gram)
    by_hand = weight.pow(2).sum(dim=0) / hinv.diagonal()  # ||W_j||^2 / Hinv_jj for single columns
    torch.testing.assert_close(scores.double(), by_hand, rtol=1e-5, atol=0)
    assert set(torch.argsort(scores)[:2].tolist()) == {3, 5}  # the cheapest two (damping 0.01 leaves a little)


def test_gqa_heads_lose_evenly_per_kv_group_and_the_update_is_the_damped_least_squares_refit(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))  # 6 query heads, 2 KV heads, head_dim 8
    stats = _stats(model, 1, ["o"])
    dense_q = ModelView(model).layer(1).linear("q").weight.detach().clone()
    ctx = _context(model, tokenizer)
    entry = obs_prune_layer(ctx, ObsPruneLayerArgs(groups=["attention_head"], ratio=1 / 3), ctx.view.layer(1), stats)
    result = entry["layers"]["o"]["1"]
    removed = sorted(result["removed"])
    assert len(removed) == 2 and removed[0] < 3 <= removed[1]  # one query head from each KV group
    kept_heads = [h for h in range(6) if h not in removed]
    kept = torch.tensor([h * 8 + d for h in kept_heads for d in range(8)])
    layer = ctx.view.layer(1)
    torch.testing.assert_close(layer.linear("q").weight, dense_q[kept])  # producers are only sliced
    # OBS with damping mu minimises E + lam ||W' - W||^2: the zero-ridge refit on G + lam I (lam = mu mean diag G).
    consumer = stats["dense_consumers"]["o"]
    lam = 0.01 * float(consumer.gram.diagonal().mean())
    damped = consumer.gram + lam * torch.eye(48, dtype=consumer.gram.dtype)
    refit = refit_least_squares(consumer.weight, damped, kept, damping=0.0)
    torch.testing.assert_close(layer.linear("o").weight, refit.weight, rtol=1e-4, atol=1e-6)
    assert result["error"] < result["error_unrefit"]


def test_with_tiny_damping_the_update_equals_the_plain_least_squares_refit():
    torch.manual_seed(0)
    x = torch.randn(12, 200, dtype=torch.float64)
    gram, weight = x @ x.T, torch.randn(5, 12, dtype=torch.float64)
    result = obs_prune(weight, gram, [[c] for c in range(12)], 4, damping=1e-12)
    refit = refit_least_squares(weight, gram, result.kept_columns, damping=0.0)
    torch.testing.assert_close(result.weight, refit.weight, rtol=1e-8, atol=1e-10)


def test_obs_prune_blocks_remove_the_same_number_from_each_block():
    torch.manual_seed(0)
    x = torch.randn(12, 100, dtype=torch.float64)
    x[:6] *= 0.01  # block 0 is far cheaper: without blocks every removal would come from it
    weight = torch.randn(4, 12, dtype=torch.float64)
    groups = [[2 * i, 2 * i + 1] for i in range(6)]
    free = obs_prune(weight, x @ x.T, groups, 2)
    assert all(g < 3 for g in free.removed_groups)
    even = obs_prune(weight, x @ x.T, groups, 2, blocks=2)
    assert sorted(g // 3 for g in even.removed_groups) == [0, 1]
    with pytest.raises(ValueError, match="split evenly over 2 blocks"):
        obs_prune(weight, x @ x.T, groups, 3, blocks=2)


def _run(tmp_path, tiny_llama_dir, stage: dict, target: dict, name: str = "run") -> dict:
    raw = tiny_recipe(tiny_llama_dir, target=target, stages=[{"sequential": [stage]}])
    return slimkit.run(raw, tmp_path / name).report.as_json()


@pytest.mark.parametrize(("rule", "of"), [("solve", "layers"), ("layer", "model")])
def test_the_stage_in_sequential_meets_the_target_like_prune_layer(tmp_path, tiny_llama_dir, rule, of):
    target = {"ratio": 0.3, "of": of, "tolerance": 0.1}
    groups = ["mlp_channel", "attention_head"]
    report = _run(
        tmp_path, tiny_llama_dir, {"stage": "obs_prune_layer", "args": {"groups": groups, "ratio_rule": rule}}, target
    )
    assert report["target"]["met"]
    entry = report["stages"]["obs_prune_layer"]
    assert set(entry["layers"]) == {"down", "o"} and all(len(v) == 3 for v in entry["layers"].values())
    prune = {"stage": "prune_layer", "args": {"groups": groups, "ratio_rule": rule}}
    plain = _run(tmp_path, tiny_llama_dir, prune, target, "plain")
    assert plain["params"]["after"] == report["params"]["after"]  # the same budget, only other units
    model, _ = slimkit.load(tmp_path / "run" / "model")
    assert torch.isfinite(model_output(model, torch.randint(3, 200, (2, 9)))).all()
    assert all(math.isfinite(v) for v in report["metrics"].values())


def test_prune_layer_can_score_with_obs_and_prune_cannot(tmp_path, tiny_llama_dir):
    stage = {"stage": "prune_layer", "args": {"groups": ["mlp_channel"], "scorer": "obs"}}
    report = _run(tmp_path, tiny_llama_dir, stage, {"ratio": 0.25, "of": "mlp", "tolerance": 0.05})
    assert report["target"]["met"] and report["stages"]["prune_layer"]["scorer"] == "obs"
    raw = tiny_recipe(tiny_llama_dir, stages=[{"stage": "prune", "args": {"scorer": "obs"}}])
    with pytest.raises(SlimkitError, match="scorer obs needs per-layer Grams; use prune_layer"):
        slimkit.run(raw, tmp_path / "model-scope")


def test_a_consumer_changed_earlier_in_the_block_is_refused(tmp_path, tiny_llama_dir):
    stages = [{"stage": "prune_layer", "args": {"ratio": 0.25}}, {"stage": "obs_prune_layer", "args": {"ratio": 0.25}}]
    raw = tiny_recipe(tiny_llama_dir, stages=[{"sequential": stages}], target={"ratio": 0.44, "of": "mlp"})
    with pytest.raises(SlimkitError, match="layer 0 down was changed by an earlier stage of the block"):
        slimkit.run(raw, tmp_path / "run")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"damping": 0}, "damping"),
        ({"damping": float("nan")}, "damping"),
        ({"damping": float("inf")}, "damping"),
        ({"groups": ["kv_group"]}, "groups"),
        ({"groups": ["mlp_channel", "mlp_channel"]}, "each kind once"),
        ({"round_to": {"mlp_channel": 0}}, "multiples must be >= 1"),
    ],
)
def test_bad_arguments_fail_validation(tiny_llama_dir, args, message):
    raw = tiny_recipe(tiny_llama_dir, stages=[{"sequential": [{"stage": "obs_prune_layer", "args": args}]}])
    with pytest.raises(SlimkitError, match=message):
        validate(raw, "t")


def test_the_bundled_recipe_validates():
    recipe, _ = load_recipe("obs-channels")
    assert [c.stage for c in recipe.stages[0].sequential] == ["obs_prune_layer"]
