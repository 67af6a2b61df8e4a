"""Building candidates from their parents and applying them (``primitives/search/build.py``): a record applied again
holds bit for bit the sub-block that was built, the parent comes back exactly, each kind does what its stage does."""

from __future__ import annotations

import pytest
import torch

from slimkit.engine.layerwise import layer_statistics
from slimkit.primitives.arch import ModelView
from slimkit.primitives.blocks import Block, without_block
from slimkit.primitives.calibration import capture_layer_inputs, run_layer
from slimkit.primitives.groups import layer_group
from slimkit.primitives.reconstruct.refit import RefitSettings, refit_role
from slimkit.primitives.search.build import (
    BuildSettings,
    LayerEvidence,
    applied,
    build_candidate,
    parent_kept,
    part_state,
)
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.costs import MemoryAt, model_memory
from slimkit.primitives.surgery import remove_units
from tests.tiny import tiny_llama, tiny_qwen3_moe

ROLES = ["down", "o", "q", "k", "v", "gate", "up"]


def _evidence(model, index: int, batches):
    view = ModelView(model)
    inputs = capture_layer_inputs(model, view.layer(0).module, batches)
    for layer in view.layers[:index]:
        inputs.hidden = run_layer(layer.module, inputs)
    stats, _ = layer_statistics(view, view.layer(index), inputs, ROLES if not _moe(model) else ["o"])
    return LayerEvidence(stats.input_norms, stats.dense_consumers or {}), stats, inputs


def _moe(model) -> bool:
    return "moe" in model.config.model_type


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    batches = [torch.randint(3, 300, (4, 16)) for _ in range(2)]
    return model, batches, torch.randint(3, 300, (2, 9))


@pytest.mark.parametrize(
    "part,name",
    [
        ("mlp", "channels:32"),
        ("attention", "heads:4"),
        ("attention", "kv_groups:1"),
        ("attention", "lowrank:0.5"),
        ("mlp", "lowrank:0.5"),
        ("mlp", "removed"),
        ("attention", "removed"),
    ],
)
def test_a_record_applied_again_is_the_built_sub_block_and_the_parent_comes_back(setup, part, name):
    model, batches, ids = setup
    evidence, _, _ = _evidence(model, 1, batches)
    spec = CandidateSpec.parse(part, name)
    dense_state = {k: v.clone() for k, v in model.state_dict().items()}
    dense_logits = _logits(model, ids)
    record = build_candidate(model, 1, spec, evidence, BuildSettings())
    assert record is not None and record.spec == spec
    # the parent is back: same tensors, same outputs
    assert model.state_dict().keys() == dense_state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in dense_state.items())
    assert torch.equal(_logits(model, ids), dense_logits)
    with applied(model, record):
        layer = ModelView(model).layer(1)
        state = part_state(layer, spec.part)
        assert state.keys() == record.tensors.keys()
        assert all(torch.equal(state[k], record.tensors[k]) for k in state)
        changed = _logits(model, ids)
    assert not torch.equal(changed, dense_logits)
    assert torch.equal(_logits(model, ids), dense_logits)
    assert record.removed["total"] > 0 and record.removed_bytes == record.removed["total"] * 4


def test_a_removed_sub_block_computes_what_skipping_it_computes(setup):
    model, batches, ids = setup
    evidence, _, _ = _evidence(model, 2, batches)
    record = build_candidate(model, 2, CandidateSpec("attention", "removed"), evidence, BuildSettings())
    with without_block(model, Block(2, "attention")):
        expected = _logits(model, ids)
    with applied(model, record):
        assert torch.equal(_logits(model, ids), expected)
    assert record.kv_heads == 0 and record.removed["attention"] == 48 * (48 + 16 + 16 + 48)


def test_channels_are_wanda_scored_and_down_is_refit_as_reconstruct_refits(setup):
    model, batches, _ = setup
    evidence, stats, _ = _evidence(model, 0, batches)
    record = build_candidate(model, 0, CandidateSpec("mlp", "channels", 32), evidence, BuildSettings())
    kept = record.structure["kept"]
    assert len(kept) == 32 and kept == sorted(kept)
    view = ModelView(model)
    layer = view.layer(0)
    norms = stats.input_norms
    down = layer.linear("down").weight
    gate, up = layer.linear("gate").weight, layer.linear("up").weight
    # Wanda's |W| ||X|| summed (l2 over each member's entries) over gate and up rows and down columns
    path = {role: view.path_of(layer.linear(role)) for role in ("gate", "up", "down")}
    score = (
        (gate.abs() * norms[path["gate"]][None, :]).norm(dim=1)
        + (up.abs() * norms[path["up"]][None, :]).norm(dim=1)
        + (down.abs() * norms[path["down"]][None, :]).norm(dim=0)
    )
    assert kept == sorted(score.argsort(descending=True)[:32].tolist())
    with parent_kept(model, 0, "mlp"):
        remove_units(model, layer_group(model, "mlp_channel", 0), kept)
        refit_role(ModelView(model).layer(0), "down", stats.consumer("down"), RefitSettings(damping=0.1))
        expected = ModelView(model).layer(0).linear("down").weight.detach().clone()
    assert torch.equal(record.tensors["mlp.down_proj.weight"], expected)


def test_experts_keep_the_most_picked():
    torch.manual_seed(0)
    model = tiny_qwen3_moe(layers=2)
    evidence, _, _ = _evidence(model, 1, [torch.randint(3, 300, (2, 8))])
    counts = torch.tensor([5.0, 9.0, 1.0, 9.0, 0.0, 3.0, 7.0, 2.0])
    evidence = LayerEvidence(evidence.input_norms, evidence.consumers, counts)
    record = build_candidate(model, 1, CandidateSpec("mlp", "experts", 4), evidence, BuildSettings())
    assert record.structure == {"kept": [0, 1, 3, 6]}
    ids = torch.randint(3, 300, (1, 7))
    with applied(model, record):
        assert _logits(model, ids).shape[-1] == model.config.vocab_size


def test_memory_counts_weights_and_the_kv_cache():
    model = tiny_llama(layers=3)
    at = MemoryAt(context=10, batch=2, kv_bytes=2)
    weights = sum(p.numel() for p in model.parameters()) * 4  # tied head once, float32
    # each layer: 2 KV heads x head_dim 8, keys and values, 10 tokens, 2 sequences, 2 bytes
    assert model_memory(model, at) == weights + 3 * 2 * 2 * 8 * 10 * 2 * 2
