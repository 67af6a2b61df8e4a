"""The families added as data, end to end on tiny random models: a width recipe and, for mixture-of-experts
families, moe-expert-prune land on target, the saved folder reloads with equal logits, and the export the family
allows passes its logit check (a plain Hugging Face folder read by stock transformers; GGUF in llama.cpp for the
dense families and GLM-4.5 within the existing tolerance)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

import slimkit
from benchmarks.exportable import LAYERS, shrink
from slimkit.primitives.export import export
from slimkit.recipes.loading import load_recipe, validate
from tests.tiny import DENSE_2026, MOE_2026, bpe_tokenizer, model_output

FACTORIES = {
    **DENSE_2026,
    **MOE_2026,
    "deepseek_v3": partial(MOE_2026["deepseek_v3"], groups=1),
    "glm4_moe": partial(MOE_2026["glm4_moe"], groups=1),
}
WIDTH_RECIPE = {family: ("wanda-channels", None) for family in FACTORIES}
WIDTH_RECIPE["gpt_oss"] = (
    "wanda-channels",
    [["stages.0.sequential.0.args.groups", ["attention_head"]], ["target.of", "attention"]],
)
WIDTH_RECIPE["olmo3"] = (
    "wanda-channels",
    [["stages.0.sequential.0.args.groups", ["mlp_channel"]], ["target.of", "mlp"]],
)
"""GPT-OSS has no MLP channels outside its experts: its width recipe prunes 20% of the attention as whole heads
(the sinks sliced with them). OLMo 3's q/k norms span the whole projections (no head can go alone): its width recipe
is the recipe's MLP-channel form (its own comment's ``--set``)."""
IDS = torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(0))
GGUF_MOE = {"glm4_moe": "glm4moe"}
"""The MoE families added as data whose GGUF layout slimkit writes (llama.cpp's architecture of each)."""


def _folder(family: str, tmp_path: Path) -> Path:
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    model = FACTORIES[family](vocab_size=len(tokenizer), layers=LAYERS)
    from slimkit.primitives.arch.fused import fused_for_save

    with fused_for_save(model):
        model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _run(recipe: str, folder: Path, overrides: list | None = None):
    _, raw = load_recipe(recipe)
    raw, _ = shrink(raw, folder)
    for dotted, value in overrides or []:
        node = raw
        *path, last = dotted.split(".")
        for key in path:
            node = node[int(key)] if key.isdigit() else node[key]
        node[last] = value
    return slimkit.run(validate(raw, recipe), folder.parent / f"run-{recipe}", force=True, evaluate=False)


def _lands_and_reloads(result, folder: Path) -> None:
    target = result.report.as_json()["target"]
    assert abs(target["achieved"] - target["ratio"]) <= 0.04, target
    loaded, _ = slimkit.load(folder)
    torch.testing.assert_close(model_output(loaded, IDS), model_output(result.model, IDS), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_the_width_recipe_lands_reloads_and_exports(family, tmp_path):
    recipe, overrides = WIDTH_RECIPE[family]
    result = _run(recipe, _folder(family, tmp_path), overrides)
    _lands_and_reloads(result, tmp_path / f"run-{recipe}" / "model")
    if family in DENSE_2026 or family in GGUF_MOE:  # per-layer / shared-expert widths padded exactly for llama.cpp
        pytest.importorskip("llama_cpp")
        from slimkit.primitives.evaluate.llamacpp import gguf_logits

        written = export(result.model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
        ids = IDS[0].tolist()
        expected = model_output(result.model, IDS[:1])[0].float()
        actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", ids, threads=2, f32_cache=True))
        assert written.architecture in ("olmo2", "glm4", *GGUF_MOE.values())
        assert float((actual - expected).abs().max()) / max(1.0, float(expected.abs().max())) <= 1e-5
    if family == "gpt_oss":  # heads pruned alike in every layer: a config transformers builds
        written = export(result.model, tmp_path / "hf", "hf", tokenizer=bpe_tokenizer())
        assert written.max_abs_logit_diff is not None and written.max_abs_logit_diff < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MOE_2026))
def test_moe_expert_prune_lands_reloads_and_exports(family, tmp_path):
    result = _run("moe-expert-prune", _folder(family, tmp_path))
    _lands_and_reloads(result, tmp_path / "run-moe-expert-prune" / "model")
    written = export(result.model, tmp_path / "hf", "hf", tokenizer=bpe_tokenizer())
    assert written.max_abs_logit_diff is not None and written.max_abs_logit_diff < 1e-4
    if family in GGUF_MOE:  # the experts kept alike in every layer: llama.cpp's one expert count
        pytest.importorskip("llama_cpp")
        from slimkit.primitives.evaluate.llamacpp import gguf_logits

        written = export(result.model, tmp_path / "m.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
        ids = IDS[0].tolist()
        expected = model_output(result.model, IDS[:1])[0].float()
        actual = torch.tensor(gguf_logits(tmp_path / "m.gguf", ids, threads=2, f32_cache=True))
        assert written.architecture == GGUF_MOE[family]
        assert float((actual - expected).abs().max()) / max(1.0, float(expected.abs().max())) <= 1e-5


@pytest.mark.slow
def test_latent_ranks_and_heads_of_latent_attention_prune_by_recipe(tmp_path):
    """wanda-channels over DeepSeek-V3's MLA heads and query / key-value latent channels: 30% of the attention."""
    overrides = [
        ["stages.0.sequential.0.args.groups", ["attention_head", "q_latent", "kv_latent"]],
        ["target.of", "attention"],
        ["target.ratio", 0.3],
    ]
    result = _run("wanda-channels", _folder("deepseek_v3", tmp_path), overrides)
    _lands_and_reloads(result, tmp_path / "run-wanda-channels" / "model")
    widths = result.report.as_json()["layers"]["after"]
    assert all(w["q_lora_rank"] < 24 and w["kv_lora_rank"] < 16 for w in widths)
