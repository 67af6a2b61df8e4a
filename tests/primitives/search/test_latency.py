"""Latency tables (``primitives/search/latency.py``): per-layer seconds added from probe models, with a timer whose
seconds are known (linear in the parameters), and the table's JSON form."""

from __future__ import annotations

import math

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.build import BuildSettings
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.latency import LatencySettings, LatencyTable, measure_table, probe
from tests.tiny import tiny_llama


class _Timing:
    """Seconds linear in the parameters; each sample a little slower than the last (disturbed), so the fastest of a
    probe's samples and of the dense samples beside it are the first ones."""

    def __init__(self) -> None:
        self.samples = 0

    def load(self, model):
        return model

    def sample(self, model):
        self.samples += 1
        params = sum(p.numel() for p in model.parameters())
        slower = 1.0 + 0.01 * self.samples
        return {"prefill": params * 1e-6 * slower, "decode": params * 1e-7 * slower}

    def close(self, handle):
        pass


def test_added_seconds_are_the_probes_difference_per_changed_layer():
    model = tiny_llama(layers=3)
    specs = [
        CandidateSpec("mlp", "removed"),
        CandidateSpec("mlp", "channels", 32),
        CandidateSpec("attention", "heads", 4),
    ]
    table = measure_table(model, specs, LatencySettings("pytorch", repeats=1), _Timing(), BuildSettings())
    # an MLP holds 3 x 48 x 64 = 9,216 weights; half its channels 4,608; two of six heads 2 x 8 x 48 x 2 (q rows,
    # o columns). Each probe sample follows the dense one beside it, 1% slower: added = (probe x (1 + 0.01) - dense)
    # / changed, with the sample counts known: dense at 1 + 0.01 k, the probe at 1 + 0.01 (k + 1).
    dense = sum(p.numel() for p in model.parameters())

    def added(removed: int, k: int, scale: float) -> float:
        return ((dense - 2 * removed) * (1 + 0.01 * (k + 1)) - dense * (1 + 0.01 * k)) * scale / 2

    # probes in sorted order: attention/heads:4 (samples 1, 2), mlp/channels:32 (3, 4), mlp/removed (5, 6)
    assert table.added["attention/heads:4"]["prefill"] == pytest.approx(added(1536, 1, 1e-6))
    assert table.added["mlp/channels:32"]["decode"] == pytest.approx(added(4608, 3, 1e-7))
    assert table.added["mlp/removed"]["prefill"] == pytest.approx(added(9216 + 48, 5, 1e-6))  # with its norm
    assert table.dense["prefill"] == pytest.approx(dense * 1.01 * 1e-6)  # the fastest dense sample, the first
    assert table.cost(CandidateSpec("mlp", "dense"), "prefill") == 0.0
    assert any("fastest" in note for note in table.notes)


def test_a_probe_changes_every_layer_but_the_first():
    model = tiny_llama(layers=3)
    probed, changed = probe(model, CandidateSpec("mlp", "channels", 16), BuildSettings())
    widths = [layer.mlp.up_proj.out_features for layer in probed.model.layers]
    assert changed == 2 and widths == [64, 16, 16]
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == [64, 64, 64]


def test_llama_cpp_runs_low_rank_as_dense():
    model = tiny_llama(layers=2)
    table = measure_table(
        model, [CandidateSpec("attention", "lowrank", 0.5)], LatencySettings("llama.cpp"), _Timing(), BuildSettings()
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


@pytest.mark.slow
def test_llama_cpp_times_probes_exported_to_gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.search.latency import LlamacppTiming
    from tests.tiny import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), layers=3)
    settings = LatencySettings("llama.cpp", context=16, new_tokens=4, repeats=2, threads=1)
    specs = [CandidateSpec("mlp", "removed"), CandidateSpec("attention", "removed")]
    table = measure_table(model, specs, settings, LlamacppTiming(tokenizer, settings), BuildSettings())
    assert set(table.added) == {"mlp/removed", "attention/removed"}
    assert all(table.dense[phase] > 0 for phase in ("prefill", "decode"))
    assert all(math.isfinite(v) for row in table.added.values() for v in row.values())  # tiny: noise-sized
