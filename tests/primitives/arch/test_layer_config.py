"""A config with a few values of its own in front of the model's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from slimkit.primitives.arch.layer_config import LayerConfig, with_own_values


def test_own_values_in_front_everything_else_read_and_written_through():
    base = SimpleNamespace(num_attention_heads=6, hidden_size=48)
    config = with_own_values(base, {"num_attention_heads": 4})
    assert (config.num_attention_heads, config.hidden_size) == (4, 48)
    config.hidden_size = 40  # not an own key: the base changes
    config.num_attention_heads = 2
    assert (base.hidden_size, base.num_attention_heads, config.num_attention_heads) == (40, 6, 2)
    again = with_own_values(config, {"num_attention_heads": 3})
    assert again.base is base and again.own == {"num_attention_heads": 3}


def test_copies_follow_the_copied_base():
    base = SimpleNamespace(heads=6)
    holder = {"base": base, "layer": LayerConfig(base, {"heads": 1})}
    twin = copy.deepcopy(holder)
    assert twin["layer"].base is twin["base"] and twin["layer"].heads == 1
    assert copy.copy(holder["layer"]).heads == 1
