"""Every decoder architecture slimkit has a spec for, on tiny random models from transformers' config classes.

(a) lossless: removing heads / KV groups / MLP channels equals zeroing what they write (through Gemma's and OLMo 2's
branch post-norms too), removing a whole block equals zeroing its branch, per-layer widths save and reload with
equal logits; (b) refusals: each refused operation fails in one line naming the architecture and the reason, before
any compute; (c) the matrix: every architecture x every bundled causal-LM recipe (shrunk to the tiny model as
``benchmarks/exportable.py`` does) lands near its target or refuses in one line, and its saved folder reloads with
equal logits. The whole matrix is slow; one recipe per architecture is in the fast tier.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch

import slimkit
from benchmarks.exportable import LAYERS, llm_recipes, shrink
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.capabilities import OPERATIONS, refusal, refusal_message
from slimkit.primitives.arch.fused import fused_for_save
from slimkit.primitives.arch.layer_kinds import merged_widths
from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.arch.spec import ARCH_SPECS, HYBRIDS, SAME_AS_LLAMA
from slimkit.primitives.arch.support import SUPPORTED, check_supported
from slimkit.primitives.blocks import Block, remove_block
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.export import export
from slimkit.primitives.export.gguf_hybrid import MAMBA_HYBRIDS
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.projection import ProjectionSettings, project_hidden_dimension
from slimkit.primitives.surgery import prune_layer, remove_units
from slimkit.recipes.loading import load_recipe, validate
from tests.tiny import (
    DECODERS,
    DENSE_2026,
    HYBRID_FAMILIES,
    HYBRID_MOE_FAMILIES,
    MOE_2026,
    NEW_FAMILIES,
    assert_scaled_close,
    bpe_tokenizer,
    byte_tokenizer,
    model_output,
    tiny_same_as_llama,
)

VOCAB = len(byte_tokenizer()) + 1
NEW = sorted({**NEW_FAMILIES, **DENSE_2026})
ALL = sorted(DECODERS)
MATRIX = {
    **DECODERS,
    **MOE_2026,
    **HYBRID_FAMILIES,
    # one router group (Kimi K2's and GLM-4.5's): whole experts then land near the target; group-limited routing is
    # tested in tests/primitives/experts/test_families_2026.py
    "deepseek_v3": partial(MOE_2026["deepseek_v3"], groups=1),
    "glm4_moe": partial(MOE_2026["glm4_moe"], groups=1),
}
"""The matrix's rows: every dense decoder, the mixture-of-experts families added as data (their tiny models have a
dense first or interleaved layer, shared experts, biases, sinks and latent attention where the family has them) and
the hybrids (tests/primitives/arch/test_hybrids.py)."""


def _model(family: str, **kwargs):
    return DECODERS[family](vocab_size=VOCAB, **kwargs)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


def _refused(family: str, operation: str) -> bool:
    return refusal(ARCH_SPECS[family], operation) is not None


# -- (a) views and lossless transforms --------------------------------------------------------------------
def test_views_see_each_new_family():
    expected_norms = {"gemma": 2, "gemma2": 4, "gemma3_text": 4, "granite": 2, "olmo2": 2, "phi3": 2}
    expected_norms |= {"olmo3": 2, "glm4": 4}
    for family in NEW:
        model = _model(family)
        layer = ModelView(model).layer(0)
        head_dim = 12 if family == "gemma3_text" else 8
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.mlp_width) == (6, 2, head_dim, 64)
        assert len(layer.norms) == expected_norms[family], family
        assert (layer.q_norm is not None) == (family in ("gemma3_text", "olmo2", "olmo3"))
        assert ModelView(model).spec.model_type == model.config.model_type == family
    olmo2 = ModelView(_model("olmo2")).layer(0)
    assert olmo2.q_norm.weight.shape == (48,)  # the whole q projection: 6 heads x 8
    with pytest.raises(SlimkitError, match=r"^olmo2 layers have no attention input norm"):
        _ = olmo2.attn_norm


def test_decoders_with_llamas_modules_need_no_new_code():
    """helium, ministral, seed_oss, smollm3: their transformers classes hold Llama's modules; pruning heads and
    channels equals zeroing them and the per-layer widths reload with equal logits."""
    for model_type in SAME_AS_LLAMA:
        model = tiny_same_as_llama(model_type, vocab_size=VOCAB)
        ids = _ids()
        group = layer_group(model, "mlp_channel", 1)
        _zero_outputs(model, "mlp_channel", 1, list(range(10, 64)))
        zeroed = model_output(model, ids)
        remove_units(model, group, torch.arange(10))
        assert_scaled_close(model_output(model, ids), zeroed, tol=1e-5)
        check_supported(model.config, "causal-lm")


def _zero_outputs(model, kind: str, layer: int, units: list[int]) -> None:
    """Zero what the units write to the residual stream (o / down input columns)."""
    with torch.no_grad():
        for member in layer_group(model, kind, layer).members:
            if member.dim == 1 and member.param == "weight":
                member.tensor(model)[:, member.indices[units].reshape(-1)] = 0.0


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize(
    ("kind", "keep"), [("mlp_channel", [0, 5, 7, 20, 33]), ("kv_group", [1]), ("attention_head", [1, 2, 4, 5])]
)
def test_removal_equals_zeroing(family, kind, keep):
    model = _model(family)
    if _refused(family, kind):
        with pytest.raises(SlimkitError, match=rf"^{kind} groups are not supported for {family}: "):
            layer_group(model, kind, 1)
        return
    ids = _ids()
    group = layer_group(model, kind, 1)
    _zero_outputs(model, kind, 1, sorted(set(range(group.size)) - set(keep)))
    zeroed = model_output(model, ids)
    remove_units(model, group, torch.tensor(keep))
    assert_scaled_close(model_output(model, ids), zeroed, tol=1e-5)


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_block_removal_equals_a_zero_branch(family, kind):
    """A removed block adds nothing, branch post-norm included (RMSNorm(0) = 0); its norms leave with it."""
    model = _model(family)
    ids = _ids()
    layer = ModelView(model).layer(1)
    before = ModelView(model).num_params()
    with torch.no_grad():
        (layer.linear("o") if kind == "attention" else layer.linear("down")).weight.zero_()
    zeroed = model_output(model, ids)
    remove_block(model, Block(1, kind))
    assert_scaled_close(model_output(model, ids), zeroed, tol=1e-6)
    norms = len(ARCH_SPECS[family].block_norms(kind))
    assert sum(isinstance(n, torch.nn.Identity) for n in ModelView(model).layer(1).norms) == norms
    assert ModelView(model).num_params() < before


def _prune_non_uniform(model) -> None:
    view = ModelView(model)
    for layer in view.layers:
        prune_layer(
            model,
            "mlp_channel",
            layer.index,
            torch.randperm(layer.mlp_width)[: layer.mlp_width - 4 * (layer.index + 1)],
        )
    family = model.config.model_type
    if not _refused(family, "kv_group"):
        prune_layer(model, "kv_group", 0, torch.tensor([1]))
        prune_layer(model, "attention_head", 2, torch.tensor([0, 2, 3, 5]))
    remove_block(model, Block(1, "attention"))


@pytest.mark.parametrize("family", NEW)
def test_per_layer_widths_save_and_reload_output_equal(family, tmp_path):
    model = _model(family)
    _prune_non_uniform(model)
    ids = _ids()
    before = model_output(model, ids)
    loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / "m"))
    assert type(loaded) is type(model)
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


def test_sliding_window_and_soft_capping_survive_the_round_trip(tmp_path):
    """The tiny Gemma 2 / 3 windows (4 tokens) are in use on 11-token inputs and stay in the saved config."""
    for family in ("gemma2", "gemma3_text"):
        model = _model(family)
        ids = _ids()
        full = DECODERS[family](vocab_size=VOCAB)
        full.config.sliding_window = 64
        for module in full.modules():
            if getattr(module, "sliding_window", None) is not None:
                module.sliding_window = 64
        full.load_state_dict(model.state_dict())
        assert not torch.allclose(model_output(full, ids), model_output(model, ids))
        _prune_non_uniform(model)
        loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / family))
        assert loaded.config.sliding_window == 4 and loaded.config.layer_types == model.config.layer_types
        assert loaded.config.final_logit_softcapping == model.config.final_logit_softcapping
        torch.testing.assert_close(model_output(loaded, ids), model_output(model, ids), rtol=0, atol=0)


def test_granite_refuses_the_projection_its_residual_multiplier_breaks():
    """Granite's residual_multiplier scales each branch: full-rank PCA with one basis per layer is not exact (the
    residual matrices between groups miss the scale), so the projection is refused; hidden features are not."""
    model = _model("granite", layers=2)
    with pytest.raises(SlimkitError, match=r"^the hidden-dimension projection is not supported for granite: its resi"):
        project_hidden_dimension(model, [_ids()], ProjectionSettings(group_size=1, ratio=0.0))
    assert len(build_groups(model, "hidden_feature")) == 1


# -- (b) refusals -------------------------------------------------------------------------------------------
def test_supported_lists_every_decoder_spec():
    moe = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}  # tests/primitives/arch/test_moe.py covers them
    assert set(SUPPORTED["causal-lm"]) == set(ALL) | set(SAME_AS_LLAMA) | moe | set(MOE_2026) | set(HYBRIDS)
    assert SUPPORTED["encoder"] == ("bert",)
    for family in ALL:
        check_supported(_model(family).config, "causal-lm")
    check_supported({"model_type": "slimkit_compressed", "slimkit_base_model_type": "gemma3_text"}, "causal-lm")


def test_each_refusal_is_one_line_naming_architecture_and_operation():
    for family in ARCH_SPECS:
        for operation in OPERATIONS:
            message = refusal_message(ARCH_SPECS[family], operation)
            if message is not None:
                assert "\n" not in message and f"not supported for {family}: " in message
                assert message.startswith(OPERATIONS[operation])


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text", "granite", "olmo2"])
def test_hidden_projection_refused_before_any_compute(family):
    model = _model(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SlimkitError, match=rf"^the hidden-dimension projection is not supported for {family}: "):
        project_hidden_dimension(model, [_ids()], ProjectionSettings(group_size=1, ratio=0.5))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_gemma_refuses_hidden_features_and_q_k_norm_models_refuse_qk_dims():
    with pytest.raises(
        SlimkitError, match=r"^hidden_feature groups are not supported for gemma2: .*sqrt\(hidden_size\)"
    ):
        build_groups(_model("gemma2"), "hidden_feature")
    with pytest.raises(SlimkitError, match=r"^qk_dim groups are not supported for gemma3_text: its per-head q/k norms"):
        build_groups(_model("gemma3_text"), "qk_dim")
    with pytest.raises(SlimkitError, match=r"^attention_head groups are not supported for olmo2: .*whole q and k"):
        build_groups(_model("olmo2"), "attention_head")
    assert len(build_groups(_model("olmo2"), "vo_dim")) == 3
    assert len(build_groups(_model("granite"), "hidden_feature")) == 1


def _run(recipe: str, family: str, folder: Path):
    _, raw = load_recipe(recipe)
    raw, _ = shrink(raw, folder)
    return slimkit.run(validate(raw, recipe), folder.parent / f"run-{recipe}", force=True, evaluate=False)


def test_a_stage_refuses_in_preflight(tmp_path):
    """A recipe whose stage the architecture refuses stops after loading, before calibration; nothing is written."""
    folder = _tiny_folder("olmo2", tmp_path)
    with pytest.raises(SlimkitError, match=r"^the hidden-dimension projection is not supported for olmo2: "):
        _run("sp3-oneshot", "olmo2", folder)
    assert not (tmp_path / "run-sp3-oneshot" / "model").exists()


# -- (c) the architecture x recipe matrix -------------------------------------------------------------------
LLM_RECIPES = sorted(name for name, why in llm_recipes().items() if why is None)
FAST = {"wanda-channels"}
"""The recipe every architecture runs in the fast tier (the rest of the matrix is slow)."""
BLOCK_RECIPES = {"blockpruner"}
"""Recipes removing whole blocks: on 4 tiny layers a block is ~6% of the model, so they land at or under target."""
OUT_OF_REACH = {("opt", "llm-pruner+sp3")}
"""Rows refused for their budget, not their architecture: the projection turns OPT's LayerNorms into RMSNorms by
centring what writes the stream, embeddings included, so OPT's tied head is untied (a vocabulary x hidden matrix
added), and the two prunable layers of the tiny model cannot remove 20% of the dense model and that head. The
refusal is ``prune``'s one line naming what the stages before it added; the row fails if it starts to land."""
MOE_UNDER_REACH = re.compile(
    r"the target needs [\d,]+ parameters of .* can remove at most|cannot remove [\d.]+% of "
    r"|the target needs \d+ channels removed from every expert"
)
"""The routed experts hold most of a tiny MoE model's parameters: a recipe whose units are heads, dense and
shared-expert channels or low-rank projections cannot remove 20% of the model there. It refuses for its budget in one
line, or (``strict: false``, as the matrix runs) lands under the target with the miss flagged. The same holds for
channels inside 16-wide experts, which keep multiples of 8."""
COARSE = {"moe-expert-prune+channels"}
"""On the tiny MoE models an expert is 16 channels wide and kept widths are multiples of 8 (transformers' grouped
expert matmul), so the channel stage moves in steps of half the routed experts: it lands within one such step."""
GRANULARITY = 0.04
"""How far a run may land from its ratio on the tiny models (whole heads and aligned channel counts of 64-wide
MLPs: llama itself lands up to 0.034 off on some recipes there)."""
HYBRID_OUT_OF_REACH = {
    (family, recipe)
    for family in ("nemotron_h", "granitemoehybrid")
    for recipe in ("llm-pruner", "llm-pruner+reconstruct", "llm-pruner+wanda")
}
"""Rows refused for their budget on the tiny Mamba hybrids: LLM-Pruner's skip_first / skip_last leave layers 1-2 of
the 4, which hold one MLP and one attention block (Nemotron-H) or one attention layer and two small MLPs (Granite
4.0-H), too few heads and channels to remove 20% of the model; the one line says so."""


def _layer_rule(recipe: str) -> bool:
    """Whether a stage of the recipe takes LoRAP's layer ratio (``ratio_rule: layer``, or a lowrank stage with
    neither a ratio nor a global allocation)."""
    _, raw = load_recipe(recipe)
    stages = [s for item in raw["stages"] for s in item.get("sequential", [item])]
    return any(
        (s.get("args") or {}).get("ratio_rule") == "layer"
        or (s["stage"] == "lowrank" and not {"ratio", "allocation"} & set(s.get("args") or {}))
        or (s["stage"] == "lowrank" and (s.get("args") or {}).get("allocation") == "lorap")
        for s in stages
    )


UNDER_TARGET = {(family, recipe) for family in HYBRID_FAMILIES for recipe in LLM_RECIPES if _layer_rule(recipe)}
"""LoRAP's layer ratio spreads the target over every layer's attention and MLP parameters, on a hybrid its gated
DeltaNet / Mamba-2 mixers included, which LoRAP's stages (low-rank q/k/v/o, MLP channels) leave alone: the run lands
under the target and says so (``met`` false; a strict target refuses in one line) unless its other stages make up
the difference."""


def _tiny_folder(family: str, tmp_path: Path) -> Path:
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path / f"tiny-{family}"
    model = MATRIX[family](vocab_size=len(tokenizer), layers=LAYERS)
    with fused_for_save(model):  # the stock folder a user brings (Phi-3's projections fused)
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _matrix_params():
    for family in sorted(MATRIX):
        for recipe in LLM_RECIPES:
            marks = () if recipe in FAST else (pytest.mark.slow,)
            yield pytest.param(family, recipe, marks=marks, id=f"{family}-{recipe}")


@pytest.mark.parametrize(("family", "recipe"), list(_matrix_params()))
def test_every_recipe_on_every_architecture(family, recipe, tmp_path):
    folder = _tiny_folder(family, tmp_path)
    if (family, recipe) in HYBRID_OUT_OF_REACH:
        with pytest.raises(SlimkitError, match=r"^(prune: the target needs|layer \d+ attention_head: removing)") as no:
            _run(recipe, family, folder)
        assert "\n" not in str(no.value)
        return
    if (family, recipe) in OUT_OF_REACH:
        with pytest.raises(SlimkitError, match=r"^prune: the target needs [\d,]+ parameters of total removed") as no:
            _run(recipe, family, folder)
        assert "\n" not in str(no.value) and "; the stages before it added " in str(no.value)
        return
    try:
        result = _run(recipe, family, folder)
    except SlimkitError as error:
        message = str(error)
        assert "\n" not in message, message
        assert family in message or (family in MOE_2026 and MOE_UNDER_REACH.search(message)), message
        return
    target = result.report.as_json()["target"]
    if family in MOE_2026 and not target["met"] and target["achieved"] < target["ratio"] - GRANULARITY:
        assert target["achieved"] > 0, target  # under reach (MOE_UNDER_REACH), flagged as missed
    elif family in MOE_2026 and recipe in COARSE:
        assert 0 < target["achieved"] and abs(target["achieved"] - target["ratio"]) <= 0.2, target
    elif recipe in BLOCK_RECIPES:
        assert 0 < target["achieved"] <= target["ratio"] + 0.01, target
    elif (family, recipe) in UNDER_TARGET and abs(target["achieved"] - target["ratio"]) > GRANULARITY:
        assert 0 < target["achieved"] < target["ratio"] and not target["met"], target
    else:
        assert abs(target["achieved"] - target["ratio"]) <= GRANULARITY, target
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    out = model_output(result.model, ids)
    assert torch.isfinite(out).all()
    loaded, _ = slimkit.load(tmp_path / f"run-{recipe}" / "model")
    assert loaded.config.model_type == family
    torch.testing.assert_close(model_output(loaded, ids), out, rtol=0, atol=1e-5)


# -- the MoE hybrids: expert recipes land a whole number of experts, reload and export -----------------------------
MOE_RECIPES = ("moe-expert-prune", "moe-expert-merge")


def _moe_folder(family: str, tmp_path: Path) -> Path:
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path / f"tiny-{family}"
    # one row beyond the tokenizer: Qwen 3.5 MoE's tokenizer class adds an end-of-text token when it loads
    HYBRID_MOE_FAMILIES[family](vocab_size=len(tokenizer) + 1, layers=LAYERS, experts=8).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("recipe", MOE_RECIPES)
@pytest.mark.parametrize("family", sorted(HYBRID_MOE_FAMILIES))
def test_moe_recipes_on_the_moe_hybrids(family, recipe, tmp_path):
    """Two of eight experts in every layer (the target set to their share of the MLP, shared expert included): the
    run lands it, the saved folder reloads with equal logits and exports as a plain folder stock transformers reads."""
    folder = _moe_folder(family, tmp_path)
    dense, _ = slimkit.load(folder)
    blocks = moe_blocks(dense)
    mlp = params_by_part(dense)["mlp"]
    _, raw = load_recipe(recipe)
    raw, _ = shrink(raw, folder)
    raw["target"] = {**raw["target"], "ratio": round(2 * len(blocks) * blocks[0].expert_params() / mlp, 4)}
    result = slimkit.run(validate(raw, recipe), tmp_path / "run", force=True, evaluate=False)
    target = result.report.as_json()["target"]
    assert target["met"], target
    assert [block.num_experts for block in moe_blocks(result.model)] == [6] * LAYERS
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    out = model_output(result.model, ids)
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    assert loaded.config.model_type == family
    torch.testing.assert_close(model_output(loaded, ids), out, rtol=0, atol=1e-5)
    exported = export(tmp_path / "run" / "model", tmp_path / "hf", format="hf")
    assert exported.max_abs_logit_diff is not None and exported.max_abs_logit_diff <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HYBRID_MOE_FAMILIES))
def test_width_recipes_on_the_moe_hybrids_prune_heads_and_refuse_channels(family, tmp_path):
    """wanda-channels asks for MLP channels, which routed experts are not: refused in one line naming the family;
    attention and DeltaNet heads alone land the target and reload."""
    folder = _moe_folder(family, tmp_path)
    with pytest.raises(SlimkitError, match=rf"^prune_layer: {family} holds its MLP as routed experts"):
        _run("wanda-channels", family, folder)
    _, raw = load_recipe("wanda-channels")
    raw, _ = shrink(raw, folder)
    raw["target"] = {**raw["target"], "ratio": 0.37, "of": "attention"}  # one head of two per group: 0.375
    raw["stages"][0]["sequential"][0]["args"]["groups"] = ["attention_head", "linear_head"]
    result = slimkit.run(validate(raw, "wanda-channels"), tmp_path / "heads", force=True, evaluate=False)
    target = result.report.as_json()["target"]
    assert abs(target["achieved"] - target["ratio"]) <= GRANULARITY, target
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    loaded, _ = slimkit.load(tmp_path / "heads" / "model")
    torch.testing.assert_close(model_output(loaded, ids), model_output(result.model, ids), rtol=0, atol=1e-5)


# -- the dense hybrids: width recipes land, reload and export ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["wanda-channels", "deploy"])
@pytest.mark.parametrize("family", sorted(HYBRID_FAMILIES))
def test_width_recipes_on_the_hybrids_reload_and_export(family, recipe, tmp_path):
    """The result reloads with equal logits; a plain folder when its widths are uniform (stock transformers' logits
    checked by the export), one line naming the per-layer widths otherwise; a GGUF of the Mamba-2 hybrids whose
    llama.cpp logits match, one line for the gated DeltaNet ones."""
    folder = _tiny_folder(family, tmp_path)
    result = _run(recipe, family, folder)
    target = result.report.as_json()["target"]
    assert abs(target["achieved"] - target["ratio"]) <= GRANULARITY, target
    saved = tmp_path / f"run-{recipe}" / "model"
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    loaded, _ = slimkit.load(saved)
    torch.testing.assert_close(model_output(loaded, ids), model_output(result.model, ids), rtol=0, atol=1e-5)
    if merged_widths(ModelView(loaded).layer_widths()) is not None:
        exported = export(saved, tmp_path / "hf", format="hf")
        assert exported.max_abs_logit_diff is not None
    else:
        with pytest.raises(SlimkitError, match=r"^per-layer widths \(.* vary across layers\) cannot be expressed"):
            export(saved, tmp_path / "hf", format="hf")
    if family not in MAMBA_HYBRIDS:
        with pytest.raises(SlimkitError, match=rf"^GGUF export of {family} is not written by slimkit"):
            export(saved, tmp_path / "m.gguf", format="gguf", type="f32")
        return
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
    from slimkit.primitives.evaluate.llamacpp import gguf_logits

    export(saved, tmp_path / "m.gguf", format="gguf", type="f32")
    tokens = ids[0].tolist()
    expected = model_output(loaded, torch.tensor([tokens]))[0]
    actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", tokens, threads=1))
    assert float((actual - expected).abs().max()) <= 1e-3 * max(float(expected.abs().max()), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "groups", "mode"),
    [
        ("qwen3_5_text", ["mlp_channel", "attention_head", "linear_head"], "prune"),
        ("nemotron_h", ["mlp_channel", "attention_head", "mamba_head"], "prune_layer"),
        ("granitemoehybrid", ["mlp_channel", "kv_group", "mamba_channel"], "prune"),
    ],
)
def test_a_hybrid_takes_one_global_budget_across_its_layer_kinds(family, groups, mode, tmp_path):
    """One target shared by units of every layer kind: ``prune`` with one threshold per kind across layers, or
    ``prune_layer`` with FLAP's global allocation; every kind gives units somewhere, the target lands, it reloads."""
    folder = _tiny_folder(family, tmp_path)
    _, raw = load_recipe("wanda-channels")
    raw, _ = shrink(raw, folder)
    if mode == "prune":
        raw["stages"] = [{"stage": "prune", "args": {"groups": groups, "scorer": "activation", "selection": "global"}}]
    else:
        raw["stages"][0]["sequential"][0]["args"].update(groups=groups, allocation={"global": {}})
    result = slimkit.run(validate(raw, "global"), tmp_path / "run", force=True, evaluate=False)
    target = result.report.as_json()["target"]
    assert abs(target["achieved"] - target["ratio"]) <= GRANULARITY, target
    dense = ModelView(MATRIX[family](vocab_size=len(bpe_tokenizer()), layers=LAYERS)).layer_widths()
    after = ModelView(result.model).layer_widths()
    changed = {key for before, now in zip(dense, after, strict=True) for key in before if before[key] != now[key]}
    unit_keys = {"mlp_channel": "intermediate", "attention_head": "num_attention_heads", "kv_group": "num_key_value"}
    unit_keys |= {"linear_head": "linear_num_value_heads", "mamba_head": "num_heads", "mamba_channel": "d_head"}
    for group in groups:  # each kind lost units in some layer (intermediate_size, shared_intermediate_size, ...)
        assert any(unit_keys[group] in key for key in changed), (group, changed)
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    torch.testing.assert_close(model_output(loaded, ids), model_output(result.model, ids), rtol=0, atol=1e-5)
