"""Groups from torch-pruning's DependencyGraph against slimkit's exact builder.

What the two builders share, on tiny Llama (GQA, tied and untied head) and tiny OPT:

* ``mlp_channel``: per layer the same members (gate/up rows, down columns; fc1 rows and bias, fc2
  columns) and the same unit -> positions mapping.
* ``hidden_feature``: the same parameters and dimensions, and the same mapping. torch-pruning also
  reaches the head's input columns; a tied head is the embedding's parameter and appears once (the
  exact builder leaves it out for the same reason), an untied head is in both. OPT's learned position
  embedding and every norm's weight (and bias) are in both.

What differs: torch-pruning's attention groups. Under grouped-query attention they couple q, k, v and o
channel for channel across different widths (wrong), so the builder skips them with a warning (or raises
with ``strict=True``); without GQA (OPT) they are kept as ``dependency`` groups of q, k, v rows and o
columns, which the exact builder has no counterpart for (it builds heads).
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from torch import nn

from slimkit.primitives.groups import Group, build_groups
from slimkit.primitives.groups.torch_pruning import (
    DEPENDENCY_KIND,
    DependencyGroupError,
    _identity_rotary,
    dependency_graph_groups,
)
from tests.tiny import tiny_llama, tiny_opt

GQA_SKIPPED = "not expressible as slimkit groups"


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (torch-pruning can loop for ever on RoPE)."""

    def _raise(signum, frame):
        raise TimeoutError(f"dependency_graph_groups took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _inputs() -> dict:
    return {"input_ids": torch.randint(3, 300, (1, 8))}


def _build(model: nn.Module) -> list[Group]:
    with deadline(60):
        if any(isinstance(m, modeling_llama.LlamaAttention) for m in model.modules()):
            with pytest.warns(UserWarning, match=GQA_SKIPPED):
                return dependency_graph_groups(model, _inputs())
        return dependency_graph_groups(model, _inputs())


def _unit_map(group: Group, model: nn.Module) -> dict:
    """{(parameter identity, dim): {positions of the reference member: positions here}} for every member.

    The reference is the first member (in parameter order) of the group; units are matched through it, so
    the builders may order units differently. Tied parameters collapse to one key.
    """
    members = {}
    for member in group.members:
        members.setdefault((id(member.tensor(model)), member.dim), member)
    reference = members[min(members, key=lambda k: _param_order(model)[k[0]] * 8 + k[1])]
    return {
        key: {tuple(r.tolist()): tuple(i.tolist()) for r, i in zip(reference.indices, m.indices, strict=True)}
        for key, m in members.items()
    }


def _param_order(model: nn.Module) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(model.parameters())}


def _keys(group: Group, model: nn.Module) -> set:
    """(module, param, dim) members, a tied parameter under its first name."""
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return {(*names[id(m.tensor(model))].rpartition(".")[::2], m.dim) for m in group.members}


@pytest.mark.parametrize(
    "factory", [tiny_llama, lambda: tiny_llama(tie=False), tiny_opt], ids=["llama", "untied", "opt"]
)
def test_mlp_channels_match_exact_builder(factory):
    model = factory()
    ours = {g.layer: g for g in _build(model) if g.kind == "mlp_channel"}
    exact = build_groups(model, "mlp_channel")
    assert sorted(ours) == [g.layer for g in exact]
    for group in exact:
        mine = ours[group.layer]
        assert {(m.module, m.param, m.dim) for m in mine.members} == {(m.module, m.param, m.dim) for m in group.members}
        assert mine.size == group.size
        assert _unit_map(mine, model) == _unit_map(group, model)
        assert mine.params_per_unit(model) == group.params_per_unit(model)


@pytest.mark.parametrize(
    "factory", [tiny_llama, lambda: tiny_llama(tie=False), tiny_opt], ids=["llama", "untied", "opt"]
)
def test_hidden_features_match_exact_builder(factory):
    model = factory()
    hidden = [g for g in _build(model) if g.kind == "hidden_feature"]
    (exact,) = build_groups(model, "hidden_feature")
    assert len(hidden) == 1 and hidden[0].layer is None
    assert _keys(hidden[0], model) == _keys(exact, model)
    assert _unit_map(hidden[0], model) == _unit_map(exact, model)
    assert hidden[0].params_per_unit(model) == exact.params_per_unit(model)


def test_attention_included_finishes_and_gqa_is_skipped():
    model = tiny_llama()
    model.train()
    frozen = model.model.embed_tokens.weight.requires_grad_(False)
    original = modeling_llama.apply_rotary_pos_emb
    seen = []

    def forward(m, inputs):
        seen.append(modeling_llama.apply_rotary_pos_emb is _identity_rotary)
        return m(**inputs).logits

    start = time.perf_counter()
    with deadline(60), pytest.warns(UserWarning, match=r"self_attn\.q_proj"):
        groups = dependency_graph_groups(model, _inputs(), forward_fn=forward)
    assert time.perf_counter() - start < 30
    assert seen == [True]  # RoPE was an identity while tracing ...
    assert modeling_llama.apply_rotary_pos_emb is original  # ... and is restored
    assert model.training and not frozen.requires_grad
    assert sorted(g.kind for g in groups) == ["hidden_feature"] + ["mlp_channel"] * 3
    assert not any(
        "self_attn" in m.module and m.dim == 0 and "o_proj" not in m.module for g in groups for m in g.members
    )
    with deadline(60), pytest.raises(DependencyGroupError):
        dependency_graph_groups(model, _inputs(), root_modules=["model.layers.0.self_attn.k_proj"], strict=True)


def test_attention_without_gqa_is_a_dependency_group():
    model = tiny_opt()
    with deadline(60):
        groups = dependency_graph_groups(model, _inputs(), root_modules=["model.decoder.layers.1.self_attn.q_proj"])
    (group,) = groups
    assert group.kind == DEPENDENCY_KIND and group.layer == 1
    assert group.extra["root"] == "model.decoder.layers.1.self_attn.q_proj"
    attn = "model.decoder.layers.1.self_attn"
    assert {(m.module, m.param, m.dim) for m in group.members} == {
        *((f"{attn}.{p}", n, 0) for p in ("q_proj", "k_proj", "v_proj") for n in ("weight", "bias")),
        (f"{attn}.out_proj", "weight", 1),
    }


class _Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 4), nn.Linear(8, 3), nn.Linear(7, 5)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x)], dim=-1))


def test_units_follow_index_mapping_through_concat():
    groups = {g.extra["root"]: g for g in dependency_graph_groups(_Concat(), torch.randn(2, 8))}
    members = {(m.module, m.param): m for m in groups["b"].members}
    assert groups["b"].kind == DEPENDENCY_KIND and groups["b"].layer is None
    assert members["b", "weight"].indices.tolist() == [[0], [1], [2]]
    assert members["c", "weight"].dim == 1
    assert members["c", "weight"].indices.tolist() == [[4], [5], [6]]
    assert {(m.module, m.param) for m in groups["a"].members} == {("a", "weight"), ("a", "bias"), ("c", "weight")}
