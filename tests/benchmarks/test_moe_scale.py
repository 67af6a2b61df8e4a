"""benchmarks.moe_scale on its tiny shape on the CPU: the one-layer build on the meta device, the timed pieces of
prune_experts, the projection and the tables (the GPU run at real shapes uses the same code)."""

from __future__ import annotations

import json

from benchmarks.moe_scale import SHAPES, main


def test_quick_run_writes_a_row_per_shape(tmp_path):
    assert main(["--quick", "--out", str(tmp_path / "q")]) == 0
    result = json.loads((tmp_path / "q.json").read_text())
    (row,) = result["rows"]
    assert row["shape"]["name"] == "tiny-moe" and row["keep"] == 12  # 25% of 16 experts removed
    assert row["exhaustive"] and row["candidates"] == 1820  # C(16, 12)
    assert row["projected_run_s"] == round(row["per_layer_s"] * 4, 2)
    assert "| tiny-moe | 16 (4) | 12 | 1820 (all) |" in (tmp_path / "q.md").read_text()


def test_real_shapes_count_their_parameters():
    qwen, mixtral = SHAPES["qwen3-30b-a3b"].params(), SHAPES["mixtral-8x7b"].params()
    assert 30.0e9 < qwen["model"] < 31.0e9  # Qwen3-30B-A3B: 30.5B
    assert 46.0e9 < mixtral["model"] < 47.0e9  # Mixtral-8x7B: 46.7B
