"""The expert_channel unit: Wanda scores on routed tokens, per-expert or shared kept channels, slicing the fused
tensors, and save / reload of narrower experts."""

import pytest
import torch

from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.experts.channels import channel_scores, keep_expert_channels, kept_channels, slice_channels
from slimkit.primitives.io.load import load
from slimkit.primitives.io.save import save
from tests.tiny import MOE_FAMILIES, byte_tokenizer, model_output


def test_scores_and_kept_channels_by_hand():
    down = torch.zeros(2, 2, 3)
    down[0, :, 0] = torch.tensor([3.0, 4.0])  # column norms: expert 0 (5, 0, 1), expert 1 (0, 2, 1)
    down[0, 0, 2] = 1.0
    down[1, 1, 1] = 2.0
    down[1, 0, 2] = 1.0
    channel_sq = torch.tensor([[4.0, 9.0, 1.0], [1.0, 1.0, 16.0]])
    scores = channel_scores(down, channel_sq)
    assert scores.tolist() == [[10.0, 0.0, 1.0], [0.0, 2.0, 4.0]]
    assert kept_channels(scores, 2, shared=False).tolist() == [[0, 2], [1, 2]]
    assert kept_channels(scores, 2, shared=True).tolist() == [[0, 2], [0, 2]]  # sums 10, 2, 5


def test_slice_channels_by_hand():
    gate_up = torch.arange(2 * 6 * 1.0).reshape(2, 6, 1)  # width 3: gate rows 0-2, up rows 3-5
    down = torch.arange(2 * 2 * 3.0).reshape(2, 2, 3)
    new_gate_up, new_down = slice_channels(gate_up, down, torch.tensor([[0, 2], [1, 2]]))
    assert new_gate_up[:, :, 0].tolist() == [[0.0, 2.0, 3.0, 5.0], [7.0, 8.0, 10.0, 11.0]]
    assert new_down.tolist() == [[[0.0, 2.0], [3.0, 5.0]], [[7.0, 8.0], [10.0, 11.0]]]


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_narrower_experts_in_one_layer_save_and_reload_with_equal_logits(tmp_path, family):
    # transformers' grouped expert matmul needs rows of a multiple of 16 bytes: widths stay multiples of 8 here
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259)
    first, second = moe_blocks(model)
    width = first.width
    index = torch.stack([torch.randperm(width)[: width - 8].sort().values for _ in range(first.num_experts)])
    keep_expert_channels(first, index)
    assert (first.width, second.width) == (width - 8, width)
    ids = torch.randint(3, 259, (2, 7))
    expected = model_output(model, ids)
    save(model, byte_tokenizer(), tmp_path / "out")
    reloaded, _ = load(tmp_path / "out", device="cpu")
    assert [b.width for b in moe_blocks(reloaded)] == [width - 8, width]
    torch.testing.assert_close(model_output(reloaded, ids), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_zero_contribution_channels_removed_everywhere_keep_the_logits(family):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259)
    ids = torch.randint(3, 259, (2, 7))
    with torch.no_grad():
        for block in moe_blocks(model):
            block.experts.down_proj[:, :, :8] = 0.0  # the first 8 channels of every expert write nothing
    expected = model_output(model, ids)
    for block in moe_blocks(model):
        keep_expert_channels(block, torch.arange(8, block.width).expand(block.num_experts, -1))
    torch.testing.assert_close(model_output(model, ids), expected, rtol=0, atol=1e-5)
