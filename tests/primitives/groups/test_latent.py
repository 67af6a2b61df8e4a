"""Multi-head latent attention's units on a tiny DeepSeek-V3: heads (both query parts, key and value, output columns)
and the query / key-value latent channels, removed exactly where they carry nothing; what MLA cannot do refused in one
line."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.surgery import remove_units
from tests.tiny import model_output, tiny_deepseek_v3

IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def test_a_head_is_its_query_parts_its_key_and_value_and_its_output_columns():
    model = tiny_deepseek_v3()
    group = layer_group(model, "attention_head", 1)
    q_b, kv_b, o = (m for m in group.members if m.param == "weight")
    assert (group.size, q_b.module.endswith("q_b_proj"), q_b.indices[1].tolist()) == (4, True, list(range(12, 24)))
    assert kv_b.indices[3].tolist() == list(range(48, 64))  # 8 key (non-rotary) + 8 value rows of head 3
    assert (o.dim, o.indices[0].tolist()) == (1, list(range(8)))
    assert ModelView(model).layer(1).num_kv_heads == 4


def test_removing_heads_equals_zeroing_their_output_columns():
    model = tiny_deepseek_v3()
    group = layer_group(model, "attention_head", 1)
    o = next(m for m in group.members if m.dim == 1)
    with torch.no_grad():
        o.tensor(model)[:, o.indices[[0, 2]].reshape(-1)] = 0.0
    zeroed = model_output(model, IDS)
    remove_units(model, group, torch.tensor([1, 3]))
    torch.testing.assert_close(model_output(model, IDS), zeroed, rtol=0, atol=1e-6)
    assert ModelView(model).layer(1).widths()["num_attention_heads"] == 2


@pytest.mark.parametrize(("kind", "keep"), [("q_latent", [0, 2, 5, 7, 11, 20]), ("kv_latent", [1, 4, 6, 9])])
def test_latent_channels_that_carry_nothing_go_without_a_trace(kind, keep):
    """Zero rows of q_a / kv_a: the channel is zero; the latent norm's weight rescaled by sqrt(R / r) keeps the norm's
    output (exact with the norm's epsilon at zero)."""
    model = tiny_deepseek_v3()
    group = layer_group(model, kind, 1)
    drop = sorted(set(range(group.size)) - set(keep))
    norm = next(m for m in group.members if "norm" in m.module)
    model.get_submodule(norm.module).variance_epsilon = 0.0
    with torch.no_grad():
        for member in group.members:
            if member.dim == 0 and member.param == "weight" and member is not norm:
                member.tensor(model)[member.indices[drop].reshape(-1)] = 0.0
    before = model_output(model, IDS)
    remove_units(model, group, torch.tensor(keep))
    torch.testing.assert_close(model_output(model, IDS), before, rtol=0, atol=1e-5)
    widths = ModelView(model).layer(1).widths()
    assert widths["q_lora_rank" if kind == "q_latent" else "kv_lora_rank"] == len(keep)
    attention = model.model.layers[1].self_attn
    assert attention.kv_lora_rank == widths["kv_lora_rank"]  # the split of kv_a's output follows the shapes


def test_what_latent_attention_cannot_do_is_refused_in_one_line():
    model = tiny_deepseek_v3()
    for kind, reason in (("kv_group", "no KV groups"), ("qk_dim", "one config value"), ("vo_dim", "one config value")):
        with pytest.raises(SlimkitError, match=rf"^{kind} groups are not supported for deepseek_v3: .*{reason}"):
            build_groups(model, kind)
    config = DeepseekV3Config(**{**model.config.to_dict(), "q_lora_rank": None})
    with pytest.raises(SlimkitError, match=r"^deepseek_v3: an attention without a query latent \(q_lora_rank null"):
        ModelView(DeepseekV3ForCausalLM(config))
