"""benchmarks.stage_memory on a small shape: every stage of a recipe measured once, beside its plan."""

from __future__ import annotations

import json

import pytest

from benchmarks.stage_memory import main


@pytest.mark.slow  # builds and compresses a small model (about 20 s here)
def test_each_stage_is_measured_beside_its_plan(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["deploy", "--hidden", "64", "--intermediate", "256", "--layers", "2", "--heads", "4"]
    # the 49,152-token embedding outweighs two small layers: targets of the layers, aligned to 8 channels
    overrides = ["--set", "target.of=layers", "--set", "target.align.mlp_channel=8", "--set", "target.tolerance=0.05"]
    assert main([*argv, *overrides, "--samples", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    rows = {(row["recipe"], row["stage"]): row for row in result["rows"]}
    assert set(rows) == {("deploy", "prune_layer"), ("deploy", "reconstruct")}
    assert rows[("deploy", "prune_layer")]["calls"] == 2  # a layer stage: once per layer, the largest kept
    for row in rows.values():
        assert row["measured_mib"] > 0 and row["planned_mib"] > 0
    assert main(["no-such-recipe"]) == 2
    assert main(["deploy", "--set", "target.ratio=2"]) == 2  # refused before a model is built
