"""Llama-family folders (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms) work in
every LLM primitive and recipe; unsupported architectures fail with one line.

(a) lossless checks per family: removing heads / KV groups / MLP channels equals zeroing them, a full-rank
low-rank pair keeps the bias, full-rank PCA projection of the hidden dimension, save→load round trips;
(b) a short end-to-end run of each bundled LLM recipe kind on each family, meeting the target, with finite
outputs, saved and reloaded output-equal; a sharded Hugging Face folder loads as a model source;
(c) refusals: qk_dim groups and DRONE Q/K projections for q/k-norm models, unsupported and custom-code configs.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, GPT2Config, LlamaConfig, LlamaForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.support import SUPPORTED, check_supported
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.primitives.masks.fusing import fuse_stream_masks, stream_count_args
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskShape, MaskValues
from slimkit.primitives.masks.sparsity import stream_model_size
from slimkit.primitives.projection import ProjectionSettings, project_hidden_dimension, stream_groups
from slimkit.primitives.projection.attention import attention_projection
from slimkit.primitives.surgery import prune_layer, remove_units
from tests.tiny import (
    _FAMILY_WIDTHS,
    FAMILIES,
    _randomise_norms,
    assert_scaled_close,
    byte_tokenizer,
    model_output,
    tiny_mistral,
)

NAMES = sorted(FAMILIES)
# One row more than the byte tokenizer: loaded for a qwen2 config, transformers' Qwen2 tokenizer adds
# '<|endoftext|>' (id 259), and slimkit.load refuses token ids beyond the embedding rows.
VOCAB = len(byte_tokenizer()) + 1


def _biased_llama(vocab_size: int, layers: int = 3) -> LlamaForCausalLM:
    """Llama with ``attention_bias`` and ``mlp_bias``: biases on q, k, v, o, gate, up and down (all random)."""
    config = LlamaConfig(
        vocab_size=vocab_size, num_hidden_layers=layers, attention_bias=True, mlp_bias=True, **_FAMILY_WIDTHS
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    return _randomise_norms(model)


BUILDERS = {**FAMILIES, "llama-bias": _biased_llama}
LOSSLESS = sorted(BUILDERS)
"""The families, plus a Llama with every Linear biased (o and MLP biases too), for the lossless checks."""


def _model(family: str, **kwargs):
    return BUILDERS[family](vocab_size=VOCAB, **kwargs)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


# -- (a) lossless checks ---------------------------------------------------------------------------------
def test_views_see_each_family():
    for family in NAMES:
        model = _model(family)
        view = ModelView(model)
        layer = view.layer(0)
        assert view.spec.model_type == family == model.config.model_type
        head_dim = 12 if family == "qwen3" else 8  # Qwen3: heads x head_dim != hidden_size, as in real ones
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.mlp_width) == (6, 2, head_dim, 64)
        assert (layer.linear("q").bias is not None) == (family == "qwen2")
        assert (layer.q_norm is not None, layer.k_norm is not None) == (family == "qwen3",) * 2
        if family == "qwen3":
            assert layer.q_norm is model.model.layers[0].self_attn.q_norm and view.spec.qk_norms


def _zero_outputs(model, kind: str, layer: int, units: list[int]) -> None:
    """Zero what the units write to the residual stream (o / down input columns)."""
    with torch.no_grad():
        for member in layer_group(model, kind, layer).members:
            if member.dim == 1 and member.param == "weight":
                member.tensor(model)[:, member.indices[units].reshape(-1)] = 0.0


@pytest.mark.parametrize("family", LOSSLESS)
@pytest.mark.parametrize(
    ("kind", "keep"), [("mlp_channel", [0, 5, 7, 20, 33]), ("kv_group", [1]), ("attention_head", [1, 2, 4, 5])]
)
def test_removal_equals_zeroing(family, kind, keep):
    model = _model(family)
    ids = _ids()
    group = layer_group(model, kind, 1)
    _zero_outputs(model, kind, 1, sorted(set(range(group.size)) - set(keep)))
    zeroed = model_output(model, ids)
    attention = model.model.layers[1].self_attn
    biases = {r: getattr(attention, f"{r}_proj").bias for r in "qkv"}
    biases = {r: b.detach().clone() for r, b in biases.items() if b is not None}
    remove_units(model, group, torch.tensor(keep))
    assert_scaled_close(model_output(model, ids), zeroed, tol=1e-5)
    layer = ModelView(model).layer(1)
    if kind != "mlp_channel":
        heads = {"kv_group": (3, 1), "attention_head": (4, 2)}[kind]
        assert (layer.num_heads, layer.num_kv_heads, attention.num_key_value_groups) == (*heads, heads[0] // heads[1])
        # The bias entries of removed q (and k/v) rows went with them; the others stayed in place.
        kept = {"q": _kept_heads(kind, keep), "k": keep if kind == "kv_group" else [0, 1]}
        kept["v"] = kept["k"]
        for role, dense in biases.items():
            rows = torch.cat([torch.arange(u * 8, u * 8 + 8) for u in kept[role]])
            torch.testing.assert_close(getattr(attention, f"{role}_proj").bias, dense[rows], rtol=0, atol=0)
    if family == "qwen3":
        assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (12,)


def _kept_heads(kind: str, keep: list[int]) -> list[int]:
    return [h for g in keep for h in range(3 * g, 3 * g + 3)] if kind == "kv_group" else keep


@pytest.mark.parametrize("family", LOSSLESS)
def test_full_rank_low_rank_pair_keeps_outputs_and_bias(family):
    model = _model(family)
    ids = _ids()
    before = model_output(model, ids)
    view = ModelView(model)
    for layer in view.layers:
        for role in ("q", "k", "v", "o"):
            linear = layer.linear(role)
            layer.set_linear(role, LowRankLinear.from_linear(linear, min(linear.weight.shape)))
            if linear.bias is not None:
                assert torch.equal(layer.linear(role).bias, linear.bias)
    assert_scaled_close(model_output(model, ids), before)


@pytest.mark.parametrize("family", LOSSLESS)
@pytest.mark.parametrize("group_size", [1, None])
def test_full_rank_pca_projection_leaves_outputs_unchanged(family, group_size):
    model = _model(family, layers=2)
    ids = _ids()
    before = model_output(model, ids)
    batches = [torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    project_hidden_dimension(model, batches, ProjectionSettings(group_size=group_size, ratio=0.0))
    assert_scaled_close(model_output(model, ids), before)


def _prune_non_uniform(model) -> None:
    view = ModelView(model)
    for layer in view.layers:
        width = layer.mlp_width - 4 * (layer.index + 1)
        prune_layer(model, "mlp_channel", layer.index, torch.randperm(layer.mlp_width)[:width])
    prune_layer(model, "kv_group", 0, torch.tensor([1]))
    prune_layer(model, "attention_head", 2, torch.tensor([0, 2, 3, 5]))


@pytest.mark.parametrize("family", LOSSLESS)
def test_per_layer_widths_save_and_load_output_equal(family, tmp_path):
    model = _model(family)
    _prune_non_uniform(model)
    ids = _ids()
    before = model_output(model, ids)
    path = slimkit.save(model, byte_tokenizer(), tmp_path / "m")
    assert json.loads((path / "slimkit_manifest.json").read_text())["model_type"] == model.config.model_type
    loaded, tokenizer = slimkit.load(path)
    assert type(loaded) is type(model) and tokenizer is not None
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
    for (name, param), (name2, param2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(param, param2), name


@pytest.mark.parametrize("family", LOSSLESS)
def test_fused_stream_masks_equal_the_masked_model_and_the_count(family):
    """SP3's LLM masks after full-rank group PCA: fusing hidden and FFN masks equals the masked model, and
    the whole-model count (biases, q/k norms included) equals the fused model's parameters."""
    model = _model(family, layers=4)
    with torch.no_grad():  # a stream of O(1), so the norms' epsilon stays negligible (see projection/slice.py)
        ModelView(model).embed_tokens.weight.mul_(50.0)
    batches = [_ids(seed) for seed in (5, 6)]
    project_hidden_dimension(model, batches, ProjectionSettings(group_size=2, ratio=0.0))
    groups = stream_groups(model)
    shape = MaskShape.from_view(ModelView(model))
    generator = torch.Generator().manual_seed(3)

    def draw(n: int) -> torch.Tensor:
        keep = (torch.rand(n, generator=generator) > 0.4).float()
        keep[0] = 1.0
        return keep

    per_group = [draw(shape.hidden) for _ in groups]
    per_layer = [per_group[g] for g, layers in enumerate(groups) for _ in layers]
    hidden = {name: list(per_layer) for name in ("mha_in", "mha_out", "ffn_in", "ffn_out")}
    values = MaskValues(**hidden, f=[draw(n) for n in shape.ffn])
    ids = _ids()
    with apply_masks(model, values, groups=groups):
        expected = model_output(model, ids)
    count = stream_model_size(values, shape, **stream_count_args(model))
    fuse_stream_masks(model, values)
    assert_scaled_close(model_output(model, ids), expected)
    assert int(count) == ModelView(model).num_params()


def test_mistral_sliding_window_survives_pruning_and_the_round_trip(tmp_path):
    windowed = tiny_mistral(vocab_size=VOCAB, sliding_window=4)
    ids = _ids()
    full = tiny_mistral(vocab_size=VOCAB, sliding_window=None)
    full.load_state_dict(windowed.state_dict())
    assert not torch.allclose(model_output(full, ids), model_output(windowed, ids))  # the window is in use
    _prune_non_uniform(windowed)
    before = model_output(windowed, ids)
    loaded, _ = slimkit.load(slimkit.save(windowed, byte_tokenizer(), tmp_path / "m"))
    assert loaded.config.sliding_window == 4
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", NAMES)
def test_sharded_folder_loads_as_a_model_source(family, tmp_path):
    model = _model(family)
    path = tmp_path / family
    model.save_pretrained(path, max_shard_size="50KB")
    byte_tokenizer().save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    loaded, tokenizer, info = slimkit.load_source(str(path))
    assert loaded.config.model_type == family and tokenizer is not None and info.task == "causal-lm"
    torch.testing.assert_close(model_output(loaded, _ids()), model_output(model, _ids()), rtol=0, atol=0)


# -- (b) every LLM recipe kind on every family -----------------------------------------------------------
MASKS = {"mask_steps": 2, "batch_size": 2, "seq_len": 16}
RECIPES: dict[str, tuple[list[dict], dict]] = {
    "lorap": (
        [
            {
                "sequential": [
                    {"stage": "lowrank", "args": {"method": "awsvd", "allocation": "lorap", "qk_share": 0.25}},
                    {"stage": "prune_layer", "args": {"scorer": "activation", "protect_lowest": 0.01}},
                ]
            },
            {"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 16}},
        ],
        {"ratio": 0.2, "of": "model"},
    ),
    "wanda-channels": (
        [
            {
                "sequential": [
                    {
                        "stage": "prune_layer",
                        "args": {"groups": ["mlp_channel", "attention_head"], "scorer": "activation"},
                    }
                ]
            }
        ],
        {"ratio": 0.2, "of": "model"},
    ),
    "llm-pruner": (
        [
            {
                "stage": "prune",
                "args": {"groups": ["attention_head", "mlp_channel"], "scorer": "taylor", "level": "element"},
            }
        ],
        {"ratio": 0.2, "of": "model"},
    ),
    "cce": (
        [
            {
                "stage": "cce",
                "args": {
                    "kinds": ["attention_head", "mlp_channel", "hidden_feature"],
                    "scorer": "coupled",
                    "gradients": "lora",
                    "lora_steps": 1,
                    "iterations": 2,
                },
            }
        ],
        {"ratio": 0.2, "of": "model"},
    ),
    "sp3-oneshot": ([{"stage": "pca_project", "args": {"group_size": 2}}], {"ratio": 0.1, "of": "model"}),
    "sp3-llm": (
        [{"stage": "pca_project", "args": {"group_size": 2, "ratio": 0.0}}, {"stage": "mask_train", "args": MASKS}],
        {"ratio": 0.2, "of": "model"},
    ),
    "prunenet": (
        [{"stage": "prunenet", "args": {"episodes": 1, "save_policy": False}}],
        {"ratio": 0.2, "of": "mlp"},
    ),
}


QKV_BIAS = {("qwen2", "q"), ("qwen2", "k"), ("qwen2", "v")}


@pytest.mark.parametrize("family", LOSSLESS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_kind_runs_on_the_family(family, recipe, tmp_path):
    stages, target = RECIPES[recipe]
    raw = {
        "name": f"{recipe}-{family}",
        "model": f"tiny-{family}",
        "seed": 0,
        "calibration": {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2},
        "target": {**target, "tolerance": 0.025},
        "stages": stages,
        "eval": {"perplexity": None},
    }
    model = _model(family)
    result = slimkit.run(raw, tmp_path / "run", model=model, tokenizer=byte_tokenizer(), evaluate=False)
    achieved = result.report.as_json()["target"]
    assert achieved["met"] and abs(achieved["achieved"] - target["ratio"]) <= 0.025
    ids = _ids()
    out = model_output(result.model, ids)
    assert torch.isfinite(out).all()
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    assert type(loaded) is type(model) and loaded.config.model_type == model.config.model_type
    torch.testing.assert_close(model_output(loaded, ids), out, rtol=0, atol=1e-5)
    attention = ModelView(result.model).layer(0).attention
    for layer in ModelView(loaded).layers:  # biases survived every transform (and none appeared)
        for role in layer.roles:
            assert (layer.linear(role).bias is not None) == (family == "llama-bias" or (family, role) in QKV_BIAS)
    if family == "qwen3":
        assert attention.q_norm.weight.shape == (12,)


# -- (c) refusals ----------------------------------------------------------------------------------------
def test_qk_norm_models_refuse_qk_dim_groups_and_qk_projections():
    model = _model("qwen3")
    with pytest.raises(SlimkitError, match=r"^qk_dim groups are not supported for qwen3: .* prune attention_head"):
        build_groups(model, "qk_dim")
    assert len(build_groups(model, "vo_dim")) == 3  # V/O dims do not pass the norms
    for family in ("llama", "qwen2"):
        assert build_groups(_model(family), "qk_dim")[0].size == 4  # RoPE pairs of head_dim 8
    w = torch.randn(16, 12)
    with pytest.raises(SlimkitError, match="per-head q/k norms"):
        attention_projection(torch.randn(20, 12), w, w, w, 2, qk_norm=True)


def test_unsupported_architectures_fail_with_one_line():
    causal = (
        "deepseek_v3, gemma, gemma2, gemma3_text, glm4, glm4_moe, gpt_oss, granite, granitemoehybrid, helium, "
        "llama, llama4_text, ministral, mistral, mixtral, nemotron_h, olmo2, olmo3, olmoe, opt, phi3, qwen2, "
        "qwen2_moe, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, seed_oss, smollm3"
    )
    message = f"model_type 'gpt2' is not supported for causal-lm recipes; supported: {causal}"
    with pytest.raises(SlimkitError) as error:
        check_supported(GPT2Config(), "causal-lm")
    assert str(error.value) == message
    with pytest.raises(
        SlimkitError,
        match=r"^model_type 'llama' is not supported for encoder recipes; supported: bert$",
    ):
        check_supported({"model_type": "llama"}, "encoder")
    for family in NAMES:
        check_supported(_model(family).config, "causal-lm")
    check_supported(AutoConfig.for_model("bert"), "encoder")
    check_supported({"model_type": "slimkit_compressed", "slimkit_base_model_type": "qwen3"}, "causal-lm")
    assert SUPPORTED == {"causal-lm": tuple(causal.split(", ")), "encoder": ("bert",)}
    with pytest.raises(SlimkitError, match=r"^unknown model task 'seq2seq'; allowed: causal-lm, encoder$"):
        check_supported(GPT2Config(), "seq2seq")

    class Fake(torch.nn.Module):
        config = GPT2Config()

    refused = r"^model_type 'gpt2' is not supported; supported: bert, deepseek_v3, gemma, "
    with pytest.raises(SlimkitError, match=refused):
        ModelView(Fake())


def test_custom_code_configs_are_refused():
    config = {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    with pytest.raises(SlimkitError) as error:
        check_supported(config, "causal-lm")
    text = str(error.value)
    assert "\n" not in text and "auto_map: AutoModelForCausalLM" in text and "trust_remote_code" in text
    assert text.endswith("supported built-in architectures for causal-lm recipes: " + ", ".join(SUPPORTED["causal-lm"]))
