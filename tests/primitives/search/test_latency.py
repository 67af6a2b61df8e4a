"""Latency tables (``primitives/search/latency.py``): per-layer seconds added from probe models, with a timer whose
seconds are known (linear in the parameters), and the table's JSON form."""

from __future__ import annotations

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.build import BuildSettings
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.latency import LatencySettings, LatencyTable, measure_table, probe
from tests.tiny import tiny_llama


def _timer(model):
    params = sum(p.numel() for p in model.parameters())
    return {"prefill": params * 1e-6, "decode": params * 1e-7}


def test_added_seconds_are_the_probes_difference_per_changed_layer():
    model = tiny_llama(layers=3)
    specs = [
        CandidateSpec("mlp", "removed"),
        CandidateSpec("mlp", "channels", 32),
        CandidateSpec("attention", "heads", 4),
    ]
    table = measure_table(model, specs, LatencySettings("pytorch"), _timer, BuildSettings())
    # an MLP holds 3 x 48 x 64 = 9,216 weights; half its channels 4,608; two of six heads 2 x 8 x 48 x 2 (q rows,
    # o columns)
    assert table.added["mlp/removed"]["prefill"] == pytest.approx(-(9216 + 48) * 1e-6)  # with its norm
    assert table.added["mlp/channels:32"]["decode"] == pytest.approx(-4608 * 1e-7)
    assert table.added["attention/heads:4"]["prefill"] == pytest.approx(-1536 * 1e-6)
    assert table.dense["prefill"] == pytest.approx(sum(p.numel() for p in model.parameters()) * 1e-6)
    assert table.cost(CandidateSpec("mlp", "dense"), "prefill") == 0.0
    assert any("timed twice" in note for note in table.notes)


def test_a_probe_changes_every_other_layer():
    model = tiny_llama(layers=3)
    probed, changed = probe(model, CandidateSpec("mlp", "channels", 16), BuildSettings())
    widths = [layer.mlp.up_proj.out_features for layer in probed.model.layers]
    assert changed == 2 and widths == [16, 64, 16]
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == [64, 64, 64]


def test_llama_cpp_runs_low_rank_as_dense():
    model = tiny_llama(layers=2)
    table = measure_table(
        model, [CandidateSpec("attention", "lowrank", 0.5)], LatencySettings("llama.cpp"), _timer, BuildSettings()
    )
    assert table.added["attention/lowrank:0.5"] == {"prefill": 0.0, "decode": 0.0}


def test_the_json_form_round_trips_and_refuses_what_is_not_a_table():
    table = LatencyTable(
        "llama.cpp", {"prefill": 1.0, "decode": 0.1}, {"mlp/removed": {"prefill": -0.1, "decode": -0.01}}
    )
    assert LatencyTable.from_json(table.to_json()) == table
    with pytest.raises(SlimkitError, match="dense needs positive seconds"):
        LatencyTable.from_json('{"runtime": "pytorch", "dense": {"prefill": 0}, "added": {}}')
    with pytest.raises(SlimkitError, match="not JSON"):
        LatencyTable.from_json("{")
    with pytest.raises(SlimkitError, match="no measured decode time for mlp/channels:3"):
        table.cost(CandidateSpec("mlp", "channels", 3), "decode")
