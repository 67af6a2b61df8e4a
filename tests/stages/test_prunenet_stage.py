"""The `prunenet` stage on a tiny model: calibration-free, saves its policy, reuses it at another ratio."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import validate
from tests.recipes.test_recipes import tiny_recipe


def prunenet_recipe(model_dir, ratio: float, **args):
    stage = {"stage": "prunenet", "args": {"episodes": 2, **args}}
    raw = tiny_recipe(model_dir, target={"ratio": ratio, "of": "mlp"}, stages=[stage])
    raw.pop("calibration")
    return raw


def test_prunenet_trains_saves_and_reuses_its_policy(tmp_path, tiny_llama_dir):
    raw = prunenet_recipe(tiny_llama_dir, 0.25)
    report = slimkit.run(raw, tmp_path / "first").report.as_json()
    assert report["calibration"] is None
    assert report["stages"]["prunenet"]["policy"]["episodes"] == 2
    assert all(w["intermediate_size"] == 48 for w in report["layers"]["after"])
    assert report["target"]["achieved"] == pytest.approx(0.25)
    policy_dir = tmp_path / "first" / "policy"
    assert (policy_dir / "policy.safetensors").is_file() and (policy_dir / "policy.json").is_file()

    reuse = prunenet_recipe(tiny_llama_dir, 0.5, policy=str(policy_dir))
    second = slimkit.run(reuse, tmp_path / "second").report.as_json()
    assert second["stages"]["prunenet"]["policy"] == {"loaded_from": str(policy_dir)}
    assert not (tmp_path / "second" / "policy").exists()
    model, _ = slimkit.load(tmp_path / "second" / "model")
    assert [layer.mlp_width for layer in ModelView(model).layers] == [32, 32, 32]


@pytest.mark.parametrize("selection", ["random", "deterministic"])
def test_prunenet_ablations_run(tmp_path, tiny_llama_dir, selection):
    raw = prunenet_recipe(tiny_llama_dir, 0.25, selection=selection, schedule="linear")
    raw["target"]["tolerance"] = 0.01  # the linear schedule rounds every layer of a 64-channel MLP
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    ratios = report["stages"]["prunenet"]["layer_ratios"]
    assert sum(ratios) / len(ratios) == pytest.approx(0.25) and ratios[0] > ratios[-1]


def _run(tmp_path, tiny_llama_dir, name: str, seed: int, **args) -> tuple[dict, dict]:
    raw = prunenet_recipe(tiny_llama_dir, 0.25, **args)
    raw["seed"] = seed
    report = slimkit.run(raw, tmp_path / name, evaluate=False).report.as_json()
    model, _ = slimkit.load(tmp_path / name / "model")
    return report, {name: p.detach().clone() for name, p in model.named_parameters() if "up_proj" in name}


@pytest.mark.parametrize("selection", ["policy", "random"])
def test_seed_drives_training_and_selection(tmp_path, tiny_llama_dir, selection):
    first, kept_first = _run(tmp_path, tiny_llama_dir, "a", 0, selection=selection)
    again, kept_again = _run(tmp_path, tiny_llama_dir, "b", 0, selection=selection)
    other, kept_other = _run(tmp_path, tiny_llama_dir, "c", 1, selection=selection)
    assert all(torch.equal(kept_first[k], kept_again[k]) for k in kept_first)
    assert not all(torch.equal(kept_first[k], kept_other[k]) for k in kept_first)
    if selection == "policy":
        penalties = [r["stages"]["prunenet"]["policy"]["episode_penalty"] for r in (first, again, other)]
        assert penalties[0] == penalties[1] != penalties[2]
        assert first["stages"]["prunenet"]["policy"]["seed"] == 0 and other["stages"]["prunenet"]["policy"]["seed"] == 1


@pytest.mark.parametrize(("returns", "update", "steps"), [("own", "layer", 2 * 3), ("future", "episode", 2)])
def test_return_and_update_options_reach_the_policy(tmp_path, tiny_llama_dir, returns, update, steps):
    raw = prunenet_recipe(tiny_llama_dir, 0.25, returns=returns, update=update)
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    policy = report["stages"]["prunenet"]["policy"]
    assert (policy["returns"], policy["update"], policy["optimizer_steps"]) == (returns, update, steps)


def test_bad_return_or_update_is_refused(tiny_llama_dir):
    for field, value in (("returns", "eq7"), ("update", "batch")):
        raw = prunenet_recipe(tiny_llama_dir, 0.25, **{field: value})
        with pytest.raises(SlimkitError, match=field):
            validate(raw, "tiny")


def test_spectrum_method_reaches_the_report_and_svd_keeps_the_same_channels(tmp_path, tiny_llama_dir):
    # the former svdvals path stays selectable; on the tiny model both methods keep the same rows
    runs = {}
    for method in ("gram", "svd"):
        report = slimkit.run(prunenet_recipe(tiny_llama_dir, 0.25, spectrum=method), tmp_path / method).report
        runs[method] = report.as_json()["stages"]["prunenet"]["policy"]
        assert runs[method]["spectrum"] == method
    assert runs["gram"]["episode_penalty"] == runs["svd"]["episode_penalty"]
    gram, _ = slimkit.load(tmp_path / "gram" / "model")
    svd, _ = slimkit.load(tmp_path / "svd" / "model")
    assert all(torch.equal(a, b) for a, b in zip(gram.state_dict().values(), svd.state_dict().values(), strict=True))


def test_memory_plan_counts_the_policy_and_one_spectrum_not_a_backward():
    from slimkit.engine.stage_memory import MemoryInputs
    from slimkit.primitives.device.memory_model import ModelShape
    from slimkit.stages.prunenet import PruneNetArgs

    shape = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)
    n, d = 14336, 4096
    parts = PruneNetArgs().memory("prunenet", MemoryInputs(shape, None, 2)).parts
    assert parts == {"policy": 16 * (n * d + n), "spectrum": 8 * n * d + 4 * d * d}
    assert set(PruneNetArgs(selection="random").memory("prunenet", MemoryInputs(shape, None, 2)).parts) == {"spectrum"}
