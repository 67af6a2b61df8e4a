"""Every registered stage and every bundled recipe through one tester, as peft runs every method through one: the
recipe validates, its memory plan is made (one entry per top-level item), it runs on a tiny random model, its output
folder is saved with a report that loads as a :class:`~slimkit.engine.report.RunReport`, and the saved model reloads
computing exactly what the run returned.

A stage runs alone (with what it needs before it: ``reconstruct`` after ``prune_layer``) on a tiny Llama, or on a tiny
BERT task model for the encoder stages; a bundled recipe runs shrunk to the tiny model (calibration, training steps
and layer-counting arguments scaled, no evaluation, target not strict). The fast tier runs two stages; the rest is
``slow``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import slimkit
from benchmarks.exportable import LAYERS, MOE_STAGES, is_moe_recipe, llm_recipes, shrink, tiny_model_dir
from slimkit.engine.memory_check import recipe_memory_plan
from slimkit.engine.report import RunReport
from slimkit.recipes.catalogue import stage_names
from slimkit.recipes.loading import bundled_recipes, load_recipe, validate
from slimkit.recipes.schema import SequentialSpec
from tests.tiny import (
    GLUE_CALIBRATION,
    bpe_tokenizer,
    byte_tokenizer,
    model_output,
    shrink_encoder_recipe,
    tiny_bert,
    tiny_llama,
)

CALIBRATION = {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2}
TRAINING = {"batch_size": 2, "seq_len": 16}


def _layer(stage: str, **args: Any) -> dict:
    return {"sequential": [{"stage": stage, "args": args}]}


STAGE_CASES: dict[str, dict[str, Any]] = {
    "prune": {"target": {"ratio": 0.2, "of": "mlp"}, "stages": [{"stage": "prune", "args": {"scorer": "taylor"}}]},
    "prune_layer": {"target": {"ratio": 0.2, "of": "mlp"}, "stages": [_layer("prune_layer", scorer="activation")]},
    "obs_prune_layer": {"target": {"ratio": 0.2, "of": "mlp"}, "stages": [_layer("obs_prune_layer")]},
    "reconstruct": {
        "target": {"ratio": 0.2, "of": "mlp"},
        "stages": [
            {
                "sequential": [
                    {"stage": "prune_layer", "args": {"scorer": "activation"}},
                    {"stage": "reconstruct", "args": {"roles": ["down"]}},
                ]
            }
        ],
    },
    "lowrank": {"target": {"ratio": 0.1, "of": "model"}, "stages": [_layer("lowrank", roles=["q", "k", "v", "o"])]},
    "cce": {
        "target": {"ratio": 0.2, "of": "mlp"},
        "stages": [{"stage": "cce", "args": {"kinds": ["mlp_channel"], "iterations": 1, "lora_steps": 1}}],
    },
    "pca_project": {
        "target": {"ratio": 0.1, "of": "model"},
        "stages": [{"stage": "pca_project", "args": {"group_size": 2}}],
    },
    "prunenet": {
        "target": {"ratio": 0.2, "of": "mlp"},
        "stages": [{"stage": "prunenet", "args": {"episodes": 1, "save_policy": False}}],
    },
    "remove_blocks": {
        "target": {"ratio": 0.0},
        "stages": [{"stage": "remove_blocks", "args": {"kinds": ["mlp"], "count": 1}}],
    },
    "mask_train": {
        "target": {"ratio": 0.2, "of": "model"},
        "stages": [
            {"stage": "mask_train", "args": {"finetune_steps": 0, "mask_steps": 2, "warmup_steps": 1, **TRAINING}}
        ],
    },
    "lora": {"target": {"ratio": 0.0}, "stages": [{"stage": "lora", "args": {"steps": 1, **TRAINING}}]},
    "distill": {"target": {"ratio": 0.0}, "stages": [{"stage": "distill", "args": {"steps": 1, **TRAINING}}]},
    "glue_finetune": {
        "task": "sst2",
        "target": {"ratio": 0.0},
        "stages": [{"stage": "glue_finetune", "args": {"max_steps": 2, "batch_size": 8, "max_length": 32}}],
    },
    "pca_project_post": {
        "task": "sst2",
        "calibration": GLUE_CALIBRATION,
        "target": {"ratio": 0.0},
        "stages": [{"stage": "pca_project_post", "args": {"tokens": None}}],
    },
    "mask_train_encoder": {
        "task": "sst2",
        "target": {"ratio": 0.3, "of": "layers", "tolerance": 0.1},
        "stages": [
            {
                "stage": "mask_train_encoder",
                "args": {
                    "hidden": "shared",  # CoFi's masks: the per-norm ones need pca_project_post first
                    "finetune_steps": 1,
                    "dimension_steps": 2,
                    "joint_steps": 2,
                    "warmup_steps": 1,
                    "batch_size": 4,
                    "max_length": 32,
                    "check_examples": 16,
                },
            }
        ],
    },
    "prune_experts": {"target": {"ratio": 0.25, "of": "mlp"}, "stages": [{"stage": "prune_experts", "args": {}}]},
    "merge_experts": {"target": {"ratio": 0.25, "of": "mlp"}, "stages": [{"stage": "merge_experts", "args": {}}]},
    "prune_expert_channels": {
        "target": {"ratio": 0.25, "of": "mlp"},
        "stages": [{"stage": "prune_expert_channels", "args": {}}],
    },
}
"""One small recipe per registered stage (its ``model`` and ``name`` filled in by the test)."""
ENCODER_STAGES = {"glue_finetune", "pca_project_post", "mask_train_encoder"}
"""Stages run on the tiny BERT task model; MOE_STAGES run on a tiny Qwen3-MoE, the rest on the tiny Llama."""
FAST_STAGES = ("prune_layer", "lowrank")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("matrix") / "tiny-llama"
    tiny_llama(vocab_size=len(tokenizer), layers=LAYERS).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return tiny_model_dir(tmp_path_factory.mktemp("matrix") / "tiny-qwen3-moe", moe=True)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("matrix") / "tiny-bert"
    tiny_bert(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_recipe(raw: dict[str, Any], name: str, out: Path) -> RunReport:
    """Validate, plan, run, save, reload; returns the report as read back from ``report.json``."""
    recipe = validate(raw, name)
    config = slimkit.load_source(recipe.model.source)[0].config
    plan = recipe_memory_plan(recipe, config, torch.float32)
    assert len(plan.stages) == len(recipe.stages)
    for item, memory in zip(recipe.stages, plan.stages, strict=True):
        children = item.sequential if isinstance(item, SequentialSpec) else [item]
        assert all(child.stage in memory.stage for child in children) and memory.total >= 0
    result = slimkit.run(recipe, out, evaluate=False)
    report = RunReport.model_validate_json((out / "report.json").read_text())
    assert sorted(report.stages) == sorted(result.report.stages) and report.target == result.report.target
    model, _tokenizer = slimkit.load(out / "model")
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model_output(model, ids), model_output(result.model, ids), rtol=1e-5, atol=1e-5)
    return report


def test_every_registered_stage_has_a_case():
    assert sorted(STAGE_CASES) == stage_names()


@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=() if s in FAST_STAGES else pytest.mark.slow) for s in sorted(STAGE_CASES)]
)
def test_stage(stage, llama_dir, bert_dir, moe_dir, tmp_path):
    raw = copy.deepcopy(STAGE_CASES[stage])
    encoder = stage in ENCODER_STAGES
    raw.setdefault("calibration", GLUE_CALIBRATION if encoder else CALIBRATION)
    raw["target"] = {"strict": False, **raw["target"]}
    model = bert_dir if encoder else moe_dir if stage in MOE_STAGES else llama_dir
    raw |= {"name": f"matrix-{stage}", "model": str(model), "seed": 0}
    raw["eval"] = {"perplexity": None}
    report = check_recipe(raw, raw["name"], tmp_path / "out")
    assert stage in report.stages or stage in {"reconstruct"}, sorted(report.stages)


def shrink_encoder(raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """An encoder (GLUE) recipe on the tiny BERT, target not strict, no evaluation."""
    raw = shrink_encoder_recipe(raw, model_dir)
    raw["target"] = {**raw["target"], "strict": False}
    raw["eval"] = {"perplexity": None}
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(bundled_recipes()))
def test_bundled_recipe(name, llama_dir, bert_dir, moe_dir, tmp_path):
    _, raw = load_recipe(name)
    if llm_recipes()[name] is None:
        raw, _changes = shrink(raw, moe_dir if is_moe_recipe(name) else llama_dir)
    else:
        raw = shrink_encoder(raw, bert_dir)
    report = check_recipe(raw, name, tmp_path / "out")
    ran = {key.split("#")[0] for key in report.stages}
    assert ran <= set(stage_names())
