"""Hybrids (decoder layers of several kinds) on tiny random models from transformers' config classes.

Per-layer kinds read from the config; each layer's units (attention heads, gated DeltaNet value heads and key groups,
Mamba-2 heads and head channels, MLP channels) removed equal to zeroing what they contribute; removing nothing changes
nothing; uniform widths save as a folder stock transformers reads, per-layer ones as slimkit's own, both reloading
with equal logits; every operation a family cannot take refused in one line naming it and the architecture.
"""

from __future__ import annotations

import copy

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.capabilities import OPERATIONS, refusal, refusal_message
from slimkit.primitives.arch.layer_kinds import LayerKind, merged_widths
from slimkit.primitives.arch.mixers import DeltaNetView, Mamba2View
from slimkit.primitives.arch.moe import moe_blocks, moe_spec
from slimkit.primitives.arch.spec import ARCH_SPECS, HYBRIDS
from slimkit.primitives.arch.support import SUPPORTED
from slimkit.primitives.device.memory_model import ModelShape
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.experts.surgery import keep_experts
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.surgery import prune_layer, remove_units
from tests.tiny import HYBRID_FAMILIES, HYBRID_MOE_FAMILIES, assert_scaled_close, byte_tokenizer, model_output

VOCAB = len(byte_tokenizer()) + 1
HYBRID_FACTORIES = {**HYBRID_FAMILIES, **HYBRID_MOE_FAMILIES}
FAMILIES = sorted(HYBRID_FACTORIES)


def _model(family: str, layers: int = 4):
    torch.manual_seed(0)
    return HYBRID_FACTORIES[family](vocab_size=VOCAB, layers=layers)


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def _no_norm_eps(model) -> None:
    """Gated RMSNorms without epsilon: Mamba-2 removals then equal zeroing to rounding (see groups/mamba.py)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNormGated"):
            module.variance_epsilon = 0.0


KINDS = {
    "qwen3_5_text": {0: ("gated_deltanet", True), 1: ("attention", True)},
    "qwen3_5_moe_text": {0: ("gated_deltanet", True), 1: ("attention", True)},
    "qwen3_next": {0: ("gated_deltanet", True), 1: ("attention", True)},
    "nemotron_h": {0: ("mamba2", False), 1: (None, True), 2: ("attention", False)},
    "granitemoehybrid": {0: ("mamba2", True), 1: ("attention", True)},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_holds_the_kind_its_config_names(family):
    view = ModelView(_model(family))
    for index, (mixer, ffn) in KINDS[family].items():
        layer = view.layer(index)
        assert layer.kind == LayerKind(mixer, ffn), (family, index)
        moe = ARCH_SPECS[family].experts is not None  # routed experts: no MLP projection modules
        assert ("q" in layer.roles) == (mixer == "attention") and ("down" in layer.roles) == (ffn and not moe)
        assert (layer.mixer is not None) == (mixer not in (None, "attention"))
        assert layer.num_heads == ((4 if moe else 6) if mixer == "attention" else 0)
    assert family in SUPPORTED["causal-lm"] and family in HYBRIDS


def test_widths_name_the_keys_of_the_kinds_each_layer_holds():
    view = ModelView(_model("qwen3_5_text"))
    assert view.layer(0).widths() == {"linear_num_value_heads": 6, "linear_num_key_heads": 2, "intermediate_size": 64}
    assert view.layer(1).widths() == {
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
    }
    assert merged_widths(view.layer_widths()) == {**view.layer(0).widths(), **view.layer(1).widths()}
    assert merged_widths([{"a": 1}, {"a": 2}]) is None


def test_mixers_count_as_attention():
    model = _model("nemotron_h")
    parts = params_by_part(model)
    mixer = sum(p.numel() for n, p in model.named_parameters() if ".layers.0.mixer." in n)  # its gated norm too
    attention = sum(p.numel() for n, p in model.named_parameters() if ".layers.2.mixer." in n)
    assert parts["attention"] == mixer + attention


def _zero(model, group, drop: list[int]) -> None:
    """Zero what units ``drop`` contribute: the columns they write into the residual stream (o, down, out_proj), or
    for Mamba-2 units their ``x`` rows and convolution channels (then the gated norm sees zeros)."""
    with torch.no_grad():
        if group.kind.startswith("mamba"):
            layer = ModelView(model).layer(group.layer)
            mixer = layer.mixer.module
            width = mixer.out_proj.in_features
            (channels,) = [m.indices for m in group.members if m.module.endswith("out_proj")]
            rows = channels[drop].reshape(-1)
            mixer.in_proj.weight[width + rows] = 0.0
            mixer.conv1d.weight[rows] = 0.0
            if mixer.conv1d.bias is not None:
                mixer.conv1d.bias[rows] = 0.0
            return
        for member in group.members:
            if member.dim == 1 and member.param == "weight":
                member.tensor(model)[:, member.indices[drop].reshape(-1)] = 0.0


CASES = [
    ("qwen3_5_text", "linear_head", 0, [0, 2, 4, 5]),  # two of three value heads under each key head
    ("qwen3_5_text", "linear_kv_group", 2, [1]),
    ("qwen3_5_text", "attention_head", 1, [1, 2, 4, 5]),
    ("qwen3_5_text", "kv_group", 1, [0]),
    ("qwen3_5_text", "mlp_channel", 0, [0, 5, 7, 20, 33]),
    ("qwen3_next", "linear_head", 0, [1, 3]),  # in_proj_qkvz / in_proj_ba rows interleaved per key head
    ("qwen3_next", "linear_kv_group", 2, [0]),
    ("qwen3_next", "attention_head", 1, [0, 3]),
    ("qwen3_5_moe_text", "linear_head", 2, [0, 3]),
    ("nemotron_h", "mamba_head", 0, [0, 3, 4, 6]),
    ("nemotron_h", "mamba_channel", 0, [1, 2, 5]),
    ("nemotron_h", "attention_head", 2, [0, 1, 3, 5]),
    ("nemotron_h", "mlp_channel", 1, [0, 5, 7, 20, 33]),
    ("granitemoehybrid", "mamba_head", 2, [1, 2, 5, 7]),
    ("granitemoehybrid", "mamba_channel", 0, [0, 4, 7, 11]),
    ("granitemoehybrid", "kv_group", 1, [1]),
    ("granitemoehybrid", "mlp_channel", 0, [0, 5, 7, 20, 33]),
]


@pytest.mark.parametrize(("family", "kind", "layer", "keep"), CASES)
def test_removal_equals_zeroing(family, kind, layer, keep):
    model = _model(family)
    _no_norm_eps(model)
    ids = _ids()
    group = layer_group(model, kind, layer)
    _zero(model, group, sorted(set(range(group.size)) - set(keep)))
    zeroed = model_output(model, ids)
    remove_units(model, group, torch.tensor(keep))
    assert_scaled_close(model_output(model, ids), zeroed, tol=1e-5)
    ModelView(model).layer(layer).sync_head_counts()  # the run-time attributes agree with the shapes


def test_mamba_removal_differs_from_zeroing_only_by_the_norm_epsilon():
    """With the gated norm's epsilon (1e-6 here) the removal is zeroing with epsilon acting as eps * K / N: close on
    the tiny model, whose gated activations are small (mean square about 1e-4)."""
    model = _model("nemotron_h")
    ids = _ids()
    group = layer_group(model, "mamba_head", 0)
    _zero(model, group, [1, 2, 5, 7])
    zeroed = model_output(model, ids)
    remove_units(model, group, torch.tensor([0, 3, 4, 6]))
    difference = (model_output(model, ids) - zeroed).abs().max().item()
    assert 0 < difference < 0.05 * zeroed.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_nothing_changes_nothing(family):
    model = _model(family)
    ids = _ids()
    before = model_output(model, ids)
    kinds = ("mlp_channel", "attention_head", "linear_head", "linear_kv_group", "mamba_head", "mamba_channel")
    for kind in (*kinds, "hidden_feature"):
        if refusal(ARCH_SPECS[family], kind) is None:
            for group in build_groups(model, kind):
                remove_units(model, group, torch.arange(group.size))
    torch.testing.assert_close(model_output(model, ids), before, rtol=0, atol=0)


def test_grouped_heads_keep_equal_numbers_under_each_key_or_ssm_group():
    model = _model("qwen3_5_text")
    with pytest.raises(SlimkitError, match=r"keeps \[2, 1\] heads in the 2 KV groups"):
        remove_units(model, layer_group(model, "linear_head", 0), [0, 1, 3])
    model = _model("nemotron_h")
    with pytest.raises(SlimkitError, match=r"keeps \[3, 1\] heads in the 2 KV groups"):
        remove_units(model, layer_group(model, "mamba_head", 0), [0, 1, 2, 4])


def test_layers_without_a_kind_have_no_groups_of_it():
    model = _model("qwen3_5_text")
    assert [g.layer for g in build_groups(model, "attention_head")] == [1, 3]
    assert [g.layer for g in build_groups(model, "linear_head")] == [0, 2]
    with pytest.raises(SlimkitError, match=r"^layer 0 has no attention_head units: it holds no softmax attention$"):
        layer_group(model, "attention_head", 0)
    nemotron = _model("nemotron_h")
    assert [g.layer for g in build_groups(nemotron, "mlp_channel")] == [1, 3]
    assert [g.layer for g in build_groups(nemotron, "mamba_head")] == [0]


def _prune(model, uniform: bool) -> None:
    view = ModelView(model)
    for layer in view.layers:
        if "down" in layer.roles:
            prune_layer(model, "mlp_channel", layer.index, torch.arange(12 if uniform else 12 + 4 * layer.index))
        if layer.has_attention:
            heads, kv = layer.num_heads, layer.num_kv_heads
            prune_layer(model, "attention_head", layer.index, torch.arange(heads).reshape(kv, -1)[:, :-1].flatten())
        mixer = layer.mixer
        if isinstance(mixer, DeltaNetView) and (uniform or layer.index):
            kept = torch.arange(mixer.num_v_heads).reshape(mixer.num_k_heads, -1)[:, 1:].flatten()
            prune_layer(model, "linear_head", layer.index, kept)
        elif isinstance(mixer, Mamba2View) and (uniform or layer.index):
            prune_layer(model, "mamba_head", layer.index, torch.tensor([0, 1, 4, 5]))
    blocks = moe_blocks(model) if moe_spec(model) is not None else []
    for block in blocks:  # routed experts: 4 of 6 (layer 0 keeps 5 when the widths differ)
        keep_experts(block, list(range(4 if uniform or block.index else 5)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("uniform", [True, False])
def test_pruned_widths_save_and_reload_with_equal_logits(family, uniform, tmp_path):
    model = _model(family)
    _prune(model, uniform)
    ids = _ids()
    before = model_output(model, ids)
    folder = slimkit.save(model, byte_tokenizer(), tmp_path / "m")
    loaded, _ = slimkit.load(folder)
    assert type(loaded) is type(model)
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    tolerance = 1e-6 if family in HYBRID_MOE_FAMILIES else 0.0  # routed tokens are summed in the order they come
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=tolerance)
    plain = (folder / "model.safetensors").is_file()
    # Granite 4.0-H's Mamba width is mamba_expand x hidden_size in its config: 4 of 8 heads is no integer factor
    assert plain == (uniform and family != "granitemoehybrid")
    if plain:
        stock = type(model).from_pretrained(folder).eval()
        torch.testing.assert_close(model_output(stock, ids), before, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
    ("family", "operation", "phrase"),
    [
        ("qwen3_5_text", "mamba_head", "it has no Mamba-2 layers"),
        ("nemotron_h", "linear_head", "it has no gated DeltaNet"),
        ("qwen3_5_text", "qk_dim", "output gate beside its query"),
        ("qwen3_5_text", "vo_dim", "output gate beside its query"),
        ("qwen3_5_text", "hidden_projection", "gated DeltaNet (linear attention) layers read and write"),
        ("nemotron_h", "hidden_masks", "Mamba-2 layers read and write"),
        ("granitemoehybrid", "blocks", "its layers are of several kinds"),
        ("nemotron_h", "expert", "no routed experts"),
    ],
)
def test_refusals_name_the_operation_and_the_architecture(family, operation, phrase):
    message = refusal_message(ARCH_SPECS[family], operation)
    assert message is not None and message.startswith(f"{OPERATIONS[operation]} ")
    assert f"not supported for {family}: " in message and phrase in message and "\n" not in message
    if operation.endswith(("_head", "_dim")):
        with pytest.raises(SlimkitError, match=rf"^{operation} groups are not supported for {family}: "):
            build_groups(_model(family), operation)


def test_a_layer_kind_the_data_does_not_know_is_refused_in_one_line():
    model = _model("nemotron_h")
    model.config.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp"]
    with pytest.raises(SlimkitError, match=r"^nemotron_h layer 1 is of kind 'moe' \(layer_types\), which slimkit"):
        ModelView(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_shape_counts_what_the_hybrid_holds(family):
    model = _model(family)
    shape = ModelShape.from_config(model.config)
    assert shape.layer_totals is not None
    assert shape.total_params() == sum(p.numel() for p in model.parameters())


def test_memory_plan_at_the_real_qwen3_5_moe_shape():
    """Qwen3.5-35B-A3B (transformers' default Qwen3_5MoeTextConfig): the plan's weights are what the config builds
    (counted on the meta device, no memory), about 35B parameters of which about 3.5B are active per token."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig()
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen3_5MoeForCausalLM(config).parameters())
    shape = ModelShape.from_config(config)
    assert shape.total_params() == total
    idle = shape.layers * (shape.experts - config.num_experts_per_tok) * 3 * shape.intermediate * shape.hidden
    assert 34e9 < total < 35e9 and 3e9 < total - idle < 4e9


def test_granite_with_routed_experts_is_refused_in_one_line():
    model = _model("granitemoehybrid")
    model.config.num_local_experts = 4
    with pytest.raises(SlimkitError, match=r"^granitemoehybrid with routed experts \(num_local_experts 4\) is not"):
        ModelView(model)


@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid"])
def test_hidden_feature_removal_equals_zeroing_up_to_the_rms_scale(family):
    """The residual stream's features reach the mixers' projections too: removing features equals zeroing them
    everywhere once each RMSNorm's weight absorbs the mean over fewer features (eps 0 makes that scale exact)."""
    model = _model(family)
    for module in model.modules():
        for attribute in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
    pruned = copy.deepcopy(model)
    dropped, width = torch.tensor([3, 17, 30]), model.config.hidden_size
    group = build_groups(model, "hidden_feature")[0]
    assert any(member.module.endswith(("in_proj", "out_proj")) for member in group.members)
    with torch.no_grad():
        for member in group.members:
            tensor = member.tensor(model)
            if "norm" in member.module:
                tensor.mul_(((width - len(dropped)) / width) ** 0.5)
            tensor.index_fill_(member.dim, member.indices[dropped].reshape(-1), 0.0)
    kept = torch.tensor(sorted(set(range(width)) - set(dropped.tolist())))
    remove_units(pruned, build_groups(pruned, "hidden_feature")[0], kept)
    torch.testing.assert_close(model_output(pruned, _ids()), model_output(model, _ids()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_a_narrower_stream_saves_and_reloads_with_equal_logits(family, tmp_path):
    model = _model(family)
    remove_units(model, build_groups(model, "hidden_feature")[0], torch.arange(2, 46))
    ids = _ids()
    before = model_output(model, ids)
    loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / "m"))
    assert ModelView(loaded).hidden_size == 44
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
