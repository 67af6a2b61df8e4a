"""``benchmarks/search_cost.py``: the search's cost planned from shapes alone (a meta-device model, no weights)."""

from __future__ import annotations

from benchmarks.search_cost import markdown, plan


def test_the_plan_counts_smollm2s_library_from_shapes():
    result = plan("smollm2-135m", 4, samples=256, seq_len=128, batch=8, holdout=1)
    # 9 query heads over 3 KV groups: heads 6 and 3, KV groups 2 and 1, low-rank 3/4, 1/2, 1/4, removed; channels in
    # eighths of 1,536 (7 levels) and removed
    assert result["candidates_per_layer"] == 16 and result["candidates"] == 480
    names = [row["candidate"] for row in result["rows"]]
    assert names[:4] == ["attention/heads:6", "attention/heads:3", "attention/kv_groups:2", "attention/kv_groups:1"]
    mlp = {row["candidate"]: row["bytes"] for row in result["rows"] if row["candidate"].startswith("mlp/")}
    assert mlp["mlp/channels:768"] == 3 * 576 * 768 * 4 + 576 * 4  # gate, up, down at half width, and the norm
    assert mlp["mlp/removed"] == 0
    assert result["memory_plan_bytes"]["dense log-probs"] == 8 * 128 * 49152 * 4
    assert "candidates: 16 per layer, 480 in all" in markdown(result)
