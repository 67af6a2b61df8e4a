"""``allocation:`` on the layer-wise removal stages and ``target.align``: a pre-pass decides each layer's share, the
block lands on the one budget, and ``uniform`` stays today's behaviour. Tiny llama: 3 layers, 64 MLP channels of 144
parameters, 6 heads in 2 KV groups (a step of one head per KV group: 1,536 parameters); 58,848 parameters with the
byte tokenizer's vocabulary."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine import runner
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import tiny_llama

SEARCH = {"search": {"budget_s": 120, "max_evals": 12, "seed": 1}}


def _run(tokenizer, args: dict, target: dict, stage: str = "prune_layer", model=None, **changes):
    model = model if model is not None else tiny_llama(vocab_size=len(tokenizer))
    raw = tiny_recipe("unused", target=target, stages=[{"sequential": [{"stage": stage, "args": args}]}], **changes)
    return slimkit.run(raw, model=model, tokenizer=tokenizer, evaluate=False)


def _mlp_widths(result) -> list[int]:
    return [layer.mlp_width for layer in ModelView(result.model).layers]


def _details(result, stage: str = "prune_layer") -> dict:
    return result.report.stages[stage].details


@pytest.mark.slow
def test_uniform_allocation_is_the_default_unchanged(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    twin = tiny_llama(vocab_size=len(tokenizer))
    twin.load_state_dict(model.state_dict())
    args = {"groups": ["mlp_channel", "attention_head"], "scorer": "activation"}
    target = {"ratio": 0.2, "of": "model"}
    default = _run(tokenizer, args, target, model=model)
    explicit = _run(tokenizer, {**args, "allocation": "uniform"}, target, model=twin)
    a, b = default.model.state_dict(), explicit.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _details(default)["fraction_mode"] == "shared" and "allocation" not in _details(default)


def test_global_allocation_lands_on_the_target_with_per_layer_shares(tokenizer):
    torch.manual_seed(0)
    args = {"groups": ["mlp_channel", "attention_head"], "scorer": "activation", "allocation": {"global": {}}}
    result = _run(tokenizer, args, {"ratio": 0.2, "of": "model"})
    assert result.report.target.met
    details = _details(result)
    assert details["fraction_mode"] == "allocated"
    allocation = details["allocation"]
    assert allocation["method"] == "global"
    assert abs(allocation["removed"] - allocation["wanted"]) <= round(0.005 * 58_848)
    assert len(set(allocation["layer_share"].values())) > 1  # not uniform
    assert _mlp_widths(result) == [allocation["kept"][str(i)]["mlp_channel"] for i in range(3)]


def test_aligned_widths_are_multiples_and_the_target_is_met(tokenizer):
    torch.manual_seed(0)
    target = {"ratio": 0.2, "of": "model", "align": {"mlp_channel": 8, "attention_head": "kv_group"}}
    for allocation in ("uniform", {"global": {}}):
        args = {"groups": ["mlp_channel", "attention_head"], "scorer": "activation", "allocation": allocation}
        result = _run(tokenizer, args, target)
        assert result.report.target.met
        assert result.report.target.align == {"mlp_channel": 8, "attention_head": "kv_group"}
        assert all(width % 8 == 0 for width in _mlp_widths(result))
        for layer in ModelView(result.model).layers:
            assert layer.num_heads % layer.num_kv_heads == 0


def test_an_aligned_target_out_of_reach_is_refused_before_calibration(tokenizer, monkeypatch):
    def no_calibration(ctx):
        raise AssertionError("calibrated before the refusal")

    monkeypatch.setattr(runner, "_calibrate", no_calibration)
    target = {"ratio": 0.2, "of": "model", "align": {"mlp_channel": 32}}
    with pytest.raises(SlimkitError) as refused:
        _run(tokenizer, {"groups": ["mlp_channel"], "scorer": "activation"}, target)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("prune_layer: groups mlp_channel (skip_first 0, skip_last 0), aligned as target.align")
    assert "nearest plans remove 0.00% or 23.49%" in message  # 0 or 3 x 32 channels x 144 of 58,848
    assert "smaller target.align multiple" in message


@pytest.mark.slow
def test_the_search_lands_on_the_budget_and_is_deterministic_per_seed(tokenizer):
    args = {"groups": ["mlp_channel", "attention_head"], "scorer": "activation", "allocation": SEARCH}
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(_run(tokenizer, args, {"ratio": 0.2, "of": "model"}))
    first, again = (_details(r)["allocation"] for r in runs)
    assert runs[0].report.target.met
    assert abs(first["removed"] - first["wanted"]) <= round(0.005 * 58_848)
    assert first["kept"] == again["kept"] and first["search"]["kl"] == again["search"]["kl"]
    trace = first["search"]["trace"]
    assert trace["evaluations"] == 12 and trace["stopped_by"] == "max_evals"
    assert first["search"]["kl"] <= first["search"]["start_kl"]
    assert _mlp_widths(runs[0]) == _mlp_widths(runs[1])


@pytest.mark.slow
def test_a_redundant_layer_gets_the_largest_share(tokenizer):
    """Layer 1's down_proj is zeroed: its MLP adds nothing, so removing its channels costs no KL."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        ModelView(model).layer(1).linear("down").weight.zero_()
    search = {"search": {"budget_s": 120, "max_evals": 40, "seed": 0}}
    args = {"groups": ["mlp_channel"], "allocation": search}
    result = _run(tokenizer, args, {"ratio": 0.25, "of": "mlp", "tolerance": 0.02}, model=model)
    assert result.report.target.met
    shares = _details(result)["allocation"]["layer_share"]
    assert shares["1"] > max(shares["0"], shares["2"])
    widths = _mlp_widths(result)
    assert widths[1] < min(widths[0], widths[2])


def test_obs_prune_layer_takes_a_global_allocation(tokenizer):
    torch.manual_seed(0)
    args = {"groups": ["mlp_channel"], "allocation": {"global": {"max_fraction": 0.6}}}
    result = _run(tokenizer, args, {"ratio": 0.25, "of": "mlp", "align": {"mlp_channel": 4}}, stage="obs_prune_layer")
    assert result.report.target.met
    details = _details(result, "obs_prune_layer")
    assert details["allocation"]["method"] == "global"
    assert all(width % 4 == 0 and width >= 26 for width in _mlp_widths(result))  # at most 60% of 64 removed


def test_refit_error_allocation_takes_most_from_the_layer_whose_channels_a_few_reproduce(tokenizer):
    """Layer 1's 64 MLP channels are scaled copies of four (channel j: gate row j % 4, up row j % 4 times a scale):
    once the kept channels include one of each four, down_proj's refit reproduces the rest exactly, so removing
    them costs nothing there, which Wanda's scores (each channel alone) cannot see."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        layer = ModelView(model).layer(1)
        gate, up = layer.linear("gate").weight, layer.linear("up").weight
        copies = torch.arange(64) % 4
        scale = 0.5 + torch.rand(64, 1)
        gate.copy_(gate[copies])
        up.copy_(up[copies] * scale)
    args = {"groups": ["mlp_channel"], "scorer": "activation", "allocation": {"global": {"by": "refit_error"}}}
    result = _run(tokenizer, args, {"ratio": 0.25, "of": "mlp", "tolerance": 0.02}, model=model)
    assert result.report.target.met
    allocation = _details(result)["allocation"]
    assert allocation["method"] == "global" and allocation["by"] == "refit_error"
    assert abs(allocation["removed"] - allocation["wanted"]) <= round(0.02 * 3 * 64 * 144)
    shares = allocation["layer_share"]
    assert shares["1"] > max(shares["0"], shares["2"])
    assert _mlp_widths(result) == [allocation["kept"][str(i)]["mlp_channel"] for i in range(3)]


def test_refit_error_allocation_of_a_unit_without_a_consumer_is_refused_at_validation(tokenizer):
    args = {"groups": ["kv_group"], "allocation": {"global": {"by": "refit_error"}}}
    with pytest.raises(SlimkitError, match=r"by refit_error .* \(got kv_group\); use by: score") as refused:
        _run(tokenizer, args, {"ratio": 0.2, "of": "model"})
    assert "\n" not in str(refused.value)
