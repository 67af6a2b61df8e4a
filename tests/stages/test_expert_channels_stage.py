"""``prune_expert_channels`` with ``refit``: on tiny MoE folders of each family the refit lowers every layer's
routed-output error on the calibration tokens (measured here against the dense layer, and as the stage reports it),
the result reloads with equal logits, and a small ``refit_memory`` splits the layers into passes without changing
the result; the memory plan counts one pass's Grams."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.calibration.routing import collect_routing
from slimkit.primitives.device.memory_model import ModelShape
from slimkit.primitives.experts.routed import ExpertWeights, expert_output, routed_output, routing
from slimkit.stages import expert_channels
from slimkit.stages.expert_channels import ExpertChannelArgs, refit_passes
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import MOE_FAMILIES, byte_tokenizer


def _folder(tmp_path, family: str, layers: int = 2):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259, layers=layers, experts=6, top_k=2)
    path = tmp_path / family
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _run(tmp_path, folder, name: str, **args):
    """Remove half of every expert's channels (8 of 16, Mixtral's 8 of 24: kept widths are multiples of 8); the run's
    result and the stage's report."""
    dense, _ = slimkit.load(folder)
    block = moe_blocks(dense)[0]
    mlp = sum(p.numel() for n, p in dense.named_parameters() if ".mlp." in n)
    removed = len(moe_blocks(dense)) * expert_channels.channel_params(block) * 8
    stages = [{"stage": "prune_expert_channels", "args": {"ratio": 0.5, **args}}]
    recipe = tiny_recipe(folder, target={"ratio": round(removed / mlp, 4), "of": "mlp"}, stages=stages)
    result = slimkit.run(recipe, tmp_path / name, evaluate=False)
    stage = result.report.as_json()["stages"]["prune_expert_channels"]
    return result, stage.get("details", stage)


def _errors(dense, pruned, x: torch.Tensor, layer: int) -> tuple[float, float]:
    """On the dense layer's router inputs ``x``: the routed output's relative error, and the experts' summed
    routing-weighted squared errors over their summed squared outputs (what the stage reports)."""
    d = ExpertWeights.of(moe_blocks(dense)[layer])
    p = ExpertWeights.of(moe_blocks(pruned)[layer])
    reference = routed_output(d, x)
    whole = float((reference - routed_output(p, x)).pow(2).sum() / reference.pow(2).sum())
    index, top = routing(d, x)
    error = energy = 0.0
    for expert in range(d.num_experts):
        token, slot = torch.where(index == expert)
        w = top[token, slot, None].double()
        out = expert_output(d, expert, x[token]).double() * w
        error += float((out - expert_output(p, expert, x[token]).double() * w).pow(2).sum())
        energy += float(out.pow(2).sum())
    return whole, error / energy


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_refit_lowers_every_layers_calibration_error_and_reloads(tmp_path, family, monkeypatch):
    folder = _folder(tmp_path, family)
    seen: list[torch.Tensor] = []
    collect = expert_channels.collect_routing

    def spy(model, batches, **kwargs):
        seen[:] = batches
        return collect(model, batches, **kwargs)

    monkeypatch.setattr(expert_channels, "collect_routing", spy)
    sliced, plain = _run(tmp_path, folder, "sliced")
    refit, report = _run(tmp_path, folder, "refit", refit=True)
    assert sliced.report.target.met and refit.report.target.met
    assert "refit_passes" not in plain and all("refit" not in layer for layer in plain["layers"])
    assert report["refit_passes"] == 1 and report["widths"] == plain["widths"]
    assert all(layer["width"] == layer["width_before"] - 8 for layer in report["layers"])
    dense, _ = slimkit.load(folder)
    inputs = collect_routing(dense, seen, keep_inputs=10**6)
    for layer, entry in enumerate(report["layers"]):
        x = inputs[layer].inputs
        assert x.shape[0] == sum(b.numel() for b in seen)  # every calibration token
        whole_sliced, sliced_error = _errors(dense, sliced.model, x, layer)
        whole_refit, refit_error = _errors(dense, refit.model, x, layer)
        assert entry["refit"]["error_sliced"] == pytest.approx(sliced_error, rel=1e-3)
        assert entry["refit"]["error_refit"] == pytest.approx(refit_error, rel=1e-3, abs=1e-7)
        assert refit_error < sliced_error and whole_refit < whole_sliced
        idle = [e for e, count in enumerate(inputs[layer].counts.tolist()) if count == 0]
        assert entry["refit"]["experts_sliced_only"] == idle and entry["refit"]["pass"] == 1
        fewest = min(c for c in inputs[layer].counts.tolist() if c > 0)
        assert entry["refit"]["fewest_tokens"] == fewest and entry["refit"]["damping"] == 0.01
    reloaded, _ = slimkit.load(tmp_path / "refit" / "model")
    ids = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, refit.model(ids).logits, rtol=0, atol=1e-5)


def test_a_small_refit_memory_splits_the_layers_into_passes_with_the_same_result(tmp_path):
    folder = _folder(tmp_path, "qwen3_moe", layers=3)
    one, one_report = _run(tmp_path, folder, "one", refit=True)
    gram = expert_channels.gram_bytes(6, 16)
    three, three_report = _run(tmp_path, folder, "three", refit=True, refit_memory=str(gram))
    assert one_report["refit_passes"] == 1 and three_report["refit_passes"] == 3
    assert [layer["refit"]["pass"] for layer in three_report["layers"]] == [3, 2, 1]  # deepest first
    assert [layer["refit"] for layer in one_report["layers"]] == [
        {**layer["refit"], "pass": 1} for layer in three_report["layers"]
    ]
    expected = one.model.state_dict()
    for name, tensor in three.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # exactly: every Gram is taken on the same dense layers


def test_refit_passes_and_memory_plan():
    assert refit_passes([(0, 5), (1, 5), (2, 5)], 10) == [[1, 2], [0]]
    assert refit_passes([(0, 5), (1, 5)], 1) == [[1], [0]]  # at least one layer a pass
    assert refit_passes([(0, 5), (1, 5)], 100) == [[0, 1]]
    shape = ModelShape(hidden=32, intermediate=16, layers=4, heads=2, kv_heads=2, head_dim=16, vocab=259, experts=6)
    inputs = MemoryInputs(shape, None, 4)
    assert "expert grams" not in ExpertChannelArgs().memory("s", inputs).parts
    layer = 6 * 16 * 16 * 4
    parts = ExpertChannelArgs(refit=True, refit_memory=str(2 * layer)).memory("s", inputs).parts
    assert parts["expert grams"] == 2 * layer
    assert parts["refit solve"] == 3 * 16 * 16 * 8 + 3 * 32 * 16 * 8
    assert ExpertChannelArgs(refit=True).memory("s", inputs).parts["expert grams"] == 4 * layer  # all four fit
    with pytest.raises(ValueError, match="refit_memory"):
        ExpertChannelArgs(refit=True, refit_memory="lots")
    with pytest.raises(ValueError, match="damping: settings of the refit"):
        ExpertChannelArgs(damping=0.1)
