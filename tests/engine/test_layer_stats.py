"""``LayerStats``: typed fields for the stages, a mapping of the set ones for the importance scorers."""

from __future__ import annotations

import pytest
import torch

from slimkit.engine.layer_stats import BlockPosition, LayerStats


def test_the_mapping_holds_the_set_fields_and_what_a_scorer_stores():
    norms = {"model.layers.0.mlp.down_proj": torch.ones(3)}
    stats = LayerStats(input_norms=norms, tokens=12)
    assert set(stats) == {"input_norms", "tokens"} and len(stats) == 2
    assert stats["input_norms"] is norms and "dense_consumers" not in stats
    with pytest.raises(KeyError):
        stats["dense_consumers"]
    stats.setdefault("coupled", {})["key"] = 1  # a scorer's memo goes beside the statistics
    assert stats.extra == {"coupled": {"key": 1}} and set(stats) == {"input_norms", "tokens", "coupled"}
    stats["tokens"] = 24
    assert stats.tokens == 24
    del stats["tokens"]
    assert stats.tokens is None and "tokens" not in stats


def test_the_block_position_reads_as_a_mapping_too():
    stats = LayerStats(block=BlockPosition("compressed", ["prune_layer"]))
    assert stats.block.earlier == ["prune_layer"]
    assert stats["block"] == {"propagate": "compressed", "earlier": ["prune_layer"]}
    assert dict(LayerStats()) == {}
