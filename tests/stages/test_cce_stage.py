"""``cce``'s memory plan: the coupled head scoring after the backward, counted where it exceeds the activations."""

from __future__ import annotations

from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.device.memory_model import ModelShape
from slimkit.recipes.schema import CalibrationConfig
from slimkit.stages.cce import CceArgs


def test_the_head_scoring_replaces_the_activations_in_the_plan_where_it_is_larger():
    """Hidden 64, 8 query heads over 2 KV groups: one group's scoring is 5 x 4 x 64 x 64 float32 = 327,680 bytes;
    with one calibration token of one sample the backward's activations are far smaller, with 512 larger."""
    shape = ModelShape(hidden=64, intermediate=128, layers=2, heads=8, kv_heads=2, head_dim=8, vocab=50, tied=True)
    tiny = CalibrationConfig(dataset="c4", samples=1, seq_len=8, batch_size=1)
    parts = CceArgs().memory("cce", MemoryInputs(shape, tiny, 4)).parts
    assert parts["activations or head scoring"] == 5 * 4 * 64 * 64 * 4 and "activations" not in parts
    large = CalibrationConfig(dataset="c4", samples=64, seq_len=512, batch_size=64)
    parts = CceArgs().memory("cce", MemoryInputs(shape, large, 4)).parts
    assert "activations" in parts and "activations or head scoring" not in parts
    assert "activations" in CceArgs(kinds=["mlp_channel"]).memory("cce", MemoryInputs(shape, tiny, 4)).parts


def test_the_stage_eliminates_the_kinds_in_the_schedules_order():
    from slimkit.primitives.select.iterative import SCHEDULE_KINDS
    from slimkit.stages.cce import KINDS

    assert KINDS == SCHEDULE_KINDS
