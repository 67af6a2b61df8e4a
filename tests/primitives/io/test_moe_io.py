"""Save / reload of MoE models with removed experts: uniform counts in the config, per-layer counts otherwise."""

import json

import pytest
import torch

from slimkit.primitives.arch.moe import MOE_SPECS, moe_blocks
from slimkit.primitives.experts import keep_experts
from slimkit.primitives.io.load import load
from slimkit.primitives.io.save import save
from tests.tiny import MOE_FAMILIES, byte_tokenizer, model_output


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_removed_experts_round_trip_with_equal_logits(tmp_path, family, uniform):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259, experts=6)
    first, second = moe_blocks(model)
    keep_experts(first, [0, 2, 3, 5])
    keep_experts(second, [1, 2, 4, 5] if uniform else [1, 4, 5])
    ids = torch.randint(3, 259, (2, 7))
    expected = model_output(model, ids)
    save(model, byte_tokenizer(), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    key = MOE_SPECS[family].count_key
    if uniform:
        assert config["model_type"] == family and config[key] == 4 and "per_layer_config" not in config
        # a plain folder: transformers alone reads it
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        torch.testing.assert_close(model_output(plain, ids), expected, rtol=0, atol=1e-5)
    else:
        assert [config["per_layer_config"][str(i)][key] for i in (0, 1)] == [4, 3]
    reloaded, _ = load(tmp_path / "out", device="cpu")
    assert [b.num_experts for b in moe_blocks(reloaded)] == ([4, 4] if uniform else [4, 3])
    torch.testing.assert_close(model_output(reloaded, ids), expected, rtol=0, atol=1e-5)
