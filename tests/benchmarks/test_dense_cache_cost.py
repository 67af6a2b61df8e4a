"""``benchmarks/dense_cache_cost.py``: the cold and warm cost of the dense cache's content key, on a tiny folder."""

from __future__ import annotations

import json
import os

from benchmarks import dense_cache_cost


def test_dense_cache_cost_measures_cold_and_warm(tiny_llama_dir, capsys):
    before = os.environ.get("SLIMKIT_CACHE_DIR")
    dense_cache_cost.main(["--source", str(tiny_llama_dir), "--repeats", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == sum(p.stat().st_size for p in tiny_llama_dir.iterdir() if p.is_file())
    assert len(result["cold_s"]) == len(result["warm_s"]) == 1
    assert os.environ.get("SLIMKIT_CACHE_DIR") == before  # the user's cache setting restored
