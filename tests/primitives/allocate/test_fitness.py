"""The search's fitness: masked units equal removed ones, and the KL divergence to the dense model."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.allocate import dense_log_probs, masked_units, mean_kl
from slimkit.primitives.groups import build_groups
from slimkit.primitives.surgery import remove_units
from tests.tiny import model_output, tiny_llama


@pytest.mark.parametrize(
    ("kind", "kept"), [("mlp_channel", [0, 3, 5, 40]), ("attention_head", [0, 4]), ("kv_group", [1])]
)
def test_masking_units_equals_removing_them(kind, kept):
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(3, 250, (2, 17))
    dense = model_output(model, ids)
    group = build_groups(model, kind, [1])[0]
    keep = torch.tensor(kept)
    with masked_units(model, [group], [keep]):
        masked = model_output(model, ids)
    assert not torch.allclose(masked, dense)
    assert torch.equal(model_output(model, ids), dense)  # the hooks are gone
    remove_units(model, group, keep)
    assert torch.allclose(masked, model_output(model, ids), atol=1e-5)


def test_the_kl_to_itself_is_zero_and_grows_with_masking():
    torch.manual_seed(0)
    model = tiny_llama()
    batches = [torch.randint(3, 250, (2, 16)) for _ in range(2)]
    dense = dense_log_probs(model, batches)
    assert mean_kl(model, batches, dense) == pytest.approx(0.0, abs=1e-6)
    groups = build_groups(model, "mlp_channel", [0, 1, 2])
    few = [torch.arange(48)] * 3
    fewer = [torch.arange(8)] * 3
    with masked_units(model, groups, few):
        some = mean_kl(model, batches, dense)
    with masked_units(model, groups, fewer):
        more = mean_kl(model, batches, dense)
    assert 0 < some < more
