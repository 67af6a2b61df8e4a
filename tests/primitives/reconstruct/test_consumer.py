"""primitives/reconstruct/consumer.py: a consumer's dense snapshot and the paired dense/compressed pass."""

from __future__ import annotations

import torch
from torch import nn

from slimkit.primitives.calibration import LayerInputs
from slimkit.primitives.reconstruct.consumer import dense_consumer, paired_pass
from slimkit.primitives.reconstruct.gram import GramStatistics


class Block(nn.Module):
    """A two-projection layer: ``down(relu(up(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_paired_pass_accumulates_the_dense_times_compressed_cross_term() -> None:
    torch.manual_seed(0)
    block = Block()
    dense = [torch.randn(2, 5, 4), torch.randn(1, 3, 4)]
    compressed = [h + 0.1 * torch.randn_like(h) for h in dense]
    kwargs: list[dict] = [{}, {}]
    terms, outputs = paired_pass(
        block, {"down": block.down}, LayerInputs(compressed, list(kwargs)), LayerInputs(dense, list(kwargs))
    )
    # By hand: the down projection's inputs on each stream, stacked over every token of every batch.
    with torch.no_grad():
        x_d = torch.cat([torch.relu(block.up(h)).reshape(-1, 6) for h in dense]).double()
        x_c = torch.cat([torch.relu(block.up(h)).reshape(-1, 6) for h in compressed]).double()
    cross, dense_sum = terms["down"]
    torch.testing.assert_close(cross, x_d.T @ x_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dense_sum, x_d.sum(0), rtol=1e-6, atol=1e-6)
    # The outputs are the dense stream's (the next layer's dense inputs), batch by batch.
    assert len(outputs) == 2
    for out, h in zip(outputs, dense, strict=True):
        torch.testing.assert_close(out, block(h).detach())
    assert not block.down._forward_pre_hooks  # the hooks are removed


def test_paired_pass_on_equal_streams_gives_the_gram_matrix() -> None:
    torch.manual_seed(1)
    block = Block()
    hidden = [torch.randn(3, 4, 4)]
    terms, _ = paired_pass(block, {"up": block.up}, LayerInputs(hidden, [{}]), LayerInputs(hidden, [{}]))
    x = hidden[0].reshape(-1, 4).double()
    torch.testing.assert_close(terms["up"][0], x.T @ x, rtol=1e-6, atol=1e-6)


def test_dense_consumer_snapshots_the_weight_and_stands_in_the_gram_for_a_missing_dense_stream() -> None:
    linear = nn.Linear(3, 2)
    stats = GramStatistics(3)
    stats.update(torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]]))
    snapshot = dense_consumer(linear, stats, None, target=True)
    assert snapshot.cross is stats.gram and snapshot.dense_sum is stats.sum  # top level: C = G, Σ x_d = Σ x
    assert snapshot.tokens == 2 and snapshot.input_sum.tolist() == [1.0, 1.0, 3.0]
    assert torch.equal(snapshot.weight, linear.weight) and snapshot.weight.data_ptr() != linear.weight.data_ptr()
    assert snapshot.bias is not None and torch.equal(snapshot.bias, linear.bias)
    with torch.no_grad():
        linear.weight.zero_()
    assert snapshot.weight.abs().sum() > 0  # a copy: later edits of the layer leave it as it was

    plain = dense_consumer(nn.Linear(3, 2, bias=False), stats, None, target=False)
    assert plain.cross is None and plain.dense_sum is None and plain.bias is None
    cross, dense_sum = torch.ones(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    paired = dense_consumer(linear, stats, (cross, dense_sum), target=True)
    assert paired.cross is cross and paired.dense_sum is dense_sum
