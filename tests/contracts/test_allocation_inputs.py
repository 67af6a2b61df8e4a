"""Bad allocation and alignment input: one ``error:`` line each (exit status 2), before any compute, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.test_cli import run_cli
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import byte_tokenizer, tiny_llama


def _model(tmp_path: Path) -> Path:
    tokenizer = byte_tokenizer()
    path = tmp_path / "model"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _stage(stage: str = "prune_layer", **args) -> list:
    return [{"sequential": [{"stage": stage, "args": {"groups": ["mlp_channel"], **args}}]}]


CASES = {
    "search-with-explicit-ratio": (
        {"stages": _stage(ratio=0.2, allocation={"search": {}})},
        "allocation: search decides each layer's share of the target, and ratio 0.2 fixes one share",
    ),
    "allocation-on-model-scope-prune": (
        {"stages": [{"stage": "prune", "args": {"allocation": {"global": {}}}}]},
        "allocation: global shares the target among layers before a layer-wise block runs",
    ),
    "search-budget-zero": (
        {"stages": _stage(allocation={"search": {"budget_s": 0}})},
        "allocation: search.budget_s: must be > 0 seconds (got 0)",
    ),
    "unknown-level-ladder": (
        {"stages": _stage(allocation={"search": {"levels": "tenth"}})},
        "search.levels: unknown level ladder 'tenth'; did you mean 'tenths'?",
    ),
    "unknown-global-criterion": (
        {"stages": _stage(allocation={"global": {"by": "error"}})},
        "allocation: global.by: Input should be 'score' or 'refit_error'",
    ),
    "refit-error-on-units-without-a-consumer": (
        {"stages": _stage(groups=["kv_group"], allocation={"global": {"by": "refit_error"}})},
        "only mlp_channel and attention_head units have (got kv_group); use by: score",
    ),
    "unknown-allocation": (
        {"stages": _stage(allocation="evolution")},
        "unknown allocation 'evolution'",
    ),
    "allocation-with-layer-rule": (
        {"stages": _stage(ratio_rule="layer", allocation={"global": {}}), "target": {"ratio": 0.2}},
        "allocation: global needs ratio_rule: solve",
    ),
    "holdout-leaves-no-batch": (
        {"stages": _stage(allocation={"search": {"holdout_batches": 2}})},
        "allocation.search.holdout_batches 2 leaves none of the 2 calibration batch(es) to score on",
    ),
    "align-conflicts-with-round-to": (
        {
            "stages": _stage(round_to={"mlp_channel": 8}),
            "target": {"ratio": 0.2, "of": "mlp", "align": {"mlp_channel": 16}},
        },
        "round_to.mlp_channel 8 conflicts with target.align.mlp_channel 16; declare it once",
    ),
    "align-unknown-kind": (
        {"target": {"ratio": 0.2, "align": {"mlp_channels": 64}}},
        "target.align: unknown unit kind 'mlp_channels'; did you mean 'mlp_channel'?",
    ),
    "align-kv-group-on-channels": (
        {"target": {"ratio": 0.2, "align": {"mlp_channel": "kv_group"}}},
        "mlp_channel: kv_group applies to attention_head",
    ),
    "aligned-target-out-of-reach": (
        {"stages": _stage(), "target": {"ratio": 0.2, "of": "model", "align": {"mlp_channel": 32}}},
        "aligned as target.align mlp_channel: 32, cannot remove 20.0% of model within target.tolerance 0.5%: "
        "the nearest plans remove 0.00% or 23.49%",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_allocation_input_is_one_line(case, monkeypatch, capsys, tmp_path):
    changes, fragment = CASES[case]
    recipe = tiny_recipe(_model(tmp_path), **changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(path), "--out", str(tmp_path / "out"))
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_an_allocated_target_out_of_reach_is_refused_before_scoring(monkeypatch, capsys, tmp_path):
    """Every group at its fewest aligned units removes nothing (the tiny MLP is 64 wide, aligned to 64): refused in
    the preflight, before calibration and before the allocation pre-pass scores any unit."""

    def no_scoring(*_args, **_kwargs):
        raise AssertionError("the allocation pre-pass ran")

    monkeypatch.setattr("slimkit.engine.allocation_prepass.dense_layer_statistics", no_scoring)
    changes = {"stages": _stage(allocation={"global": {}}), "target": {"ratio": 0.2, "align": {"mlp_channel": 64}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(_model(tmp_path), **changes)))
    code, _out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(path), "--out", str(tmp_path / "out"))
    assert code == 2, err
    assert err.strip().startswith(
        "error: prune_layer (allocation global): groups mlp_channel (skip_first 0, skip_last 0), aligned as "
        "target.align mlp_channel: 64, cannot remove 20.0% of model"
    ), err
    assert "the nearest plans remove 0.00%" in err and "finer group kind" not in err
    assert not (tmp_path / "out").exists()
