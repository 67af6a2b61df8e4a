"""Memory-lean gradient statistics: only the scored tensors and moments, each gradient folded in and freed."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.calibration.gradients import accumulate_gradients
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.tensor_bytes import LiveTensorBytes
from slimkit.primitives.groups import build_groups
from slimkit.primitives.importance import member_tensors
from slimkit.primitives.importance.compose import parse_scorer, spec_gradients
from slimkit.primitives.importance.coupled import coupled_gradient_weights
from slimkit.stages.prune import PruneArgs
from tests.tiny import tiny_llama


def full_buffer_sums(model, batches):
    """The previous algorithm: every parameter requires a gradient; float32 sums of g and g^2 for all of them."""
    params = list(model.parameters())
    grad = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in params}
    grad_sq = {id(p): torch.zeros_like(p, dtype=torch.float32) for p in params}
    model.eval()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(batch, labels=batch, use_cache=False).loss.float().backward()
        for p in params:
            if p.grad is not None:
                g = p.grad.float()
                grad[id(p)] += g
                grad_sq[id(p)] += g * g
    model.zero_grad(set_to_none=True)
    return grad, grad_sq


def _batches(n: int = 3, length: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (2, length), generator=generator) for _ in range(n)]


def _scored(model) -> list[torch.Tensor]:
    groups = build_groups(model, "mlp_channel", [1, 2]) + build_groups(model, "attention_head", [1])
    return list(member_tensors(model, groups))


@pytest.mark.parametrize("squares", [False, True])
def test_lean_sums_equal_full_buffer_sums_for_scored_tensors(squares):
    model, batches = tiny_llama(layers=4), _batches()
    expected, expected_sq = full_buffer_sums(model, batches)
    scored = _scored(model)
    stats = accumulate_gradients(model, batches, tensors=scored, squares=squares)
    assert stats.batches == len(batches)
    for tensor in scored:
        grad, grad_sq = stats.of(tensor)
        assert grad.dtype == torch.float32
        assert torch.equal(grad, expected[id(tensor)])
        if squares:
            assert torch.equal(grad_sq, expected_sq[id(tensor)])
        else:
            assert grad_sq is None
    # unscored tensors get no statistics (the embeddings, layer 0, the norms)
    assert len(stats.grad) == len(scored)
    embeddings = model.get_input_embeddings().weight
    assert embeddings not in stats
    with pytest.raises(SlimkitError, match="no gradient statistics"):
        stats.of(embeddings)
    # no gradient is left on the model, and requires_grad flags are restored
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


def test_bfloat16_sums_are_float32_and_match():
    model, batches = tiny_llama(layers=3).to(torch.bfloat16), _batches(2)
    expected, _ = full_buffer_sums(model, batches)
    scored = _scored(model)
    stats = accumulate_gradients(model, batches, tensors=scored, squares=False)
    for tensor in scored:
        assert stats.of(tensor)[0].dtype == torch.float32
        assert torch.equal(stats.of(tensor)[0], expected[id(tensor)])


def test_stats_on_cpu_and_checkpointed_layers_give_the_same_sums():
    model, batches = tiny_llama(layers=4), _batches()
    scored = _scored(model)
    plain = accumulate_gradients(model, batches, tensors=scored, squares=True)
    moved = accumulate_gradients(model, batches, tensors=scored, squares=True, stats_device="cpu")
    recomputed = accumulate_gradients(model, batches, tensors=scored, squares=True, checkpoint_layers=True)
    for tensor in scored:
        assert moved.of(tensor)[0].device.type == "cpu"
        torch.testing.assert_close(moved.of(tensor)[0], plain.of(tensor)[0], rtol=0, atol=0)
        torch.testing.assert_close(recomputed.of(tensor)[0], plain.of(tensor)[0])
        torch.testing.assert_close(recomputed.of(tensor)[1], plain.of(tensor)[1])
    # the layers' own forward is back once the pass is over
    assert all("forward" not in vars(layer) for layer in model.model.layers)


def test_peak_tracked_memory_falls():
    model, batches = tiny_llama(layers=4), _batches(2, 32)
    scored = _scored(model)
    with LiveTensorBytes() as old:
        full_buffer_sums(model, batches)
    with LiveTensorBytes() as lean:
        accumulate_gradients(model, batches, tensors=scored, squares=False)
    with LiveTensorBytes() as recomputed:
        accumulate_gradients(model, batches, tensors=scored, squares=False, checkpoint_layers=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    sums = sum(t.numel() * 4 for t in scored)
    assert old.peak > 3 * weights  # two float32 buffers per parameter, the .grad tensors, activations
    assert lean.peak < 0.6 * old.peak, (lean.peak, old.peak)
    assert lean.peak >= sums  # the sums themselves live to the end
    assert recomputed.peak < lean.peak, (recomputed.peak, lean.peak)


def test_scorers_request_only_what_they_read(llama):
    groups = build_groups(llama, "mlp_channel", [1])
    first = spec_gradients(parse_scorer("taylor"), llama, groups, {"order": "first"})
    assert not first.squares
    assert {id(t) for t in first.tensors} == {id(t) for t in member_tensors(llama, groups)}
    assert spec_gradients(parse_scorer("taylor"), llama, groups, {"order": "mix"}).squares
    coupled = spec_gradients(parse_scorer("coupled"), llama, groups, {})
    assert not coupled.squares
    assert {id(t) for t in coupled.tensors} == {id(t) for t in coupled_gradient_weights(llama, groups)}
    blend = spec_gradients(parse_scorer({"blend": {"taylor": 1, "magnitude": 1}}), llama, groups, {"order": "second"})
    assert blend.squares and len(blend.tensors) == len(first.tensors)
    assert spec_gradients(parse_scorer("magnitude"), llama, groups, {}) is None


def test_gradient_options_need_a_gradient_scorer():
    with pytest.raises(ValueError, match="stats_device: only for scorers that read gradients"):
        PruneArgs(scorer="activation", stats_device="cpu")
    with pytest.raises(ValueError, match="checkpoint_layers: only for scorers that read gradients"):
        PruneArgs(scorer="magnitude", checkpoint_layers=True)
    with pytest.raises(ValueError, match="stats_device"):
        PruneArgs(scorer="taylor", stats_device="gpu")
    assert PruneArgs(scorer="taylor", stats_device="cpu", checkpoint_layers=True).stats_device == "cpu"
