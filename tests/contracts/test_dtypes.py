"""Every stage works in the model's own dtype (float32 and bfloat16 here, on the CPU; CUDA when present).

Two kinds of test:

* Every registered stage runs in a minimal recipe (``slimkit.run`` on an in-memory tiny model cast to the
  dtype, tiny budgets) and the result must keep the dtype (no parameter silently cast to float32; trained
  masks and LoRA adapters are fused/merged, so none remain), run a forward pass with finite outputs, and
  meet the recipe's target.
* The lossless transforms in bfloat16 (norm folding, full-rank PCA projection and fusing, post-norm
  re-representation, save/load, removing units whose contribution is zero): outputs are compared with the
  *same bfloat16 model before the transform* (the statement "the transform is lossless up to the dtype's
  round-off"), with :func:`tests.tiny.assert_scaled_close` at ``tol`` 3e-2 for bfloat16 (about four times
  its epsilon 7.8e-3: the transform is computed in float64 and rounded once into every weight, and the
  forward pass then rounds again in every layer) and the usual 1e-4 for float32. Save/load must be exact.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors import safe_open

import slimkit
from slimkit.primitives.device.moves import input_device, math_dtype, to_input_device, upcast
from slimkit.primitives.finetune.loop import FloatMaster
from slimkit.primitives.groups import build_groups
from slimkit.primitives.projection.hidden import ProjectionSettings, project_hidden_dimension
from slimkit.primitives.projection.norms import fold_rms_norms, layernorm_to_rmsnorm
from slimkit.primitives.projection.postnorm import project_post_norm
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.catalogue import stage_names
from tests.tiny import (
    assert_scaled_close,
    byte_tokenizer,
    model_output,
    tiny_bert,
    tiny_llama,
    tiny_mixtral,
    tiny_opt,
    tiny_qwen3_moe,
)

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CALIBRATION = {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2}
GLUE_CALIBRATION = {"dataset": "glue", "samples": 4, "seq_len": 32, "batch_size": 2, "examples": 32}
MODEL_TARGET = {"ratio": 0.2, "of": "model", "tolerance": 0.025}
FINETUNE = {"stage": "glue_finetune", "args": {"max_steps": 2, "batch_size": 8, "max_length": 32}}
ENCODER_MASKS = {  # sp3-bert.yaml's settings (without its layer and MHA-intermediate masks) at a tiny budget
    "hidden": "per_norm",
    "head": True,
    "layer": False,
    "learning_rate": 2.0e-5,
    "mask_learning_rate": 0.05,
    "lagrangian_learning_rate": 0.1,
    "init_drop": 0.05,
    "finetune_steps": 1,
    "dimension_steps": 2,
    "joint_steps": 2,
    "warmup_steps": 1,
    "batch_size": 4,
    "max_length": 32,
    "check_examples": 16,
}


def _sp3_bert(mask_args: dict, tolerance: float) -> dict:
    """The recipe changes of an sp3-bert-like run: task fine-tuning, post-norm projection, encoder masks."""
    return {
        "task": "sst2",
        "calibration": GLUE_CALIBRATION,
        "target": {"ratio": 0.5, "of": "layers", "tolerance": tolerance},
        "stages": [
            FINETUNE,
            {"stage": "pca_project_post", "args": {"tokens": None}},
            {"stage": "mask_train_encoder", "args": mask_args},
        ],
        "eval": {"glue": {"limit": 8, "batch_size": 8, "max_length": 32}},
    }


# case -> (model factory, recipe changes); every registered stage appears in at least one case.
CASES: dict[str, tuple[str, dict]] = {
    "prune-taylor": (
        "llama",
        {"stages": [{"stage": "prune", "args": {"groups": ["attention_head", "mlp_channel"], "scorer": "taylor"}}]},
    ),
    "prune-opt-activation": (
        "opt",
        {"target": {"ratio": 0.25, "of": "mlp"}, "stages": [{"stage": "prune", "args": {"scorer": "activation"}}]},
    ),
    "prune_layer": (
        "llama",
        {"stages": [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}]},
    ),
    "prune_layer+reconstruct": (
        "llama",
        {
            "stages": [
                {
                    "sequential": [
                        {"stage": "prune_layer", "args": {"scorer": "activation"}},
                        {"stage": "reconstruct"},
                    ]
                }
            ]
        },
    ),
    "lowrank+prune_layer": (
        "llama",
        {
            "stages": [
                {
                    "sequential": [
                        {"stage": "lowrank", "args": {"method": "awsvd"}},
                        {"stage": "prune_layer", "args": {"scorer": "activation", "protect_lowest": 0.01}},
                    ]
                }
            ]
        },
    ),
    "cce-coupled-lora": (
        "llama",
        {
            "stages": [
                {
                    "stage": "cce",
                    "args": {"kinds": ["attention_head", "mlp_channel"], "gradients": "lora", "iterations": 2},
                }
            ]
        },
    ),
    "cce-magnitude": (
        "llama",
        {"stages": [{"stage": "cce", "args": {"kinds": ["mlp_channel"], "scorer": "magnitude", "iterations": 2}}]},
    ),
    "prunenet": ("llama", {"stages": [{"stage": "prunenet", "args": {"episodes": 1, "save_policy": False}}]}),
    "pca_project": ("llama", {"stages": [{"stage": "pca_project", "args": {"group_size": 2}}]}),
    "pca_project-opt": ("opt", {"stages": [{"stage": "pca_project", "args": {"group_size": "all"}}]}),
    "pca_project+mask_train": (
        "llama",
        {
            "stages": [
                {"stage": "pca_project", "args": {"group_size": 2, "ratio": 0.0}},
                {"stage": "mask_train", "args": {"mask_steps": 3, "batch_size": 2, "seq_len": 16}},
            ]
        },
    ),
    "remove_blocks": (
        "llama",
        {
            "stages": [
                {"stage": "remove_blocks", "args": {"count": 1, "kinds": ["attention"]}},
                {"stage": "prune", "args": {"groups": ["mlp_channel"], "scorer": "magnitude"}},
            ]
        },
    ),
    "obs_prune_layer": (
        "llama",
        {
            "stages": [
                {"sequential": [{"stage": "obs_prune_layer", "args": {"groups": ["mlp_channel", "attention_head"]}}]}
            ]
        },
    ),
    "prune+lora": (
        "llama",
        {
            "stages": [
                {"stage": "prune", "args": {"scorer": "magnitude"}},
                {"stage": "lora", "args": {"steps": 2, "batch_size": 2, "seq_len": 16}},
            ]
        },
    ),
    # whole routed experts of MoE models: 25% of the MLPs is 2 of every layer's 8 experts
    "prune_experts": ("qwen3_moe", {"target": {"ratio": 0.25, "of": "mlp"}, "stages": [{"stage": "prune_experts"}]}),
    "merge_experts": ("mixtral", {"target": {"ratio": 0.25, "of": "mlp"}, "stages": [{"stage": "merge_experts"}]}),
    # channels inside the experts: 8 of tiny Mixtral's 24 per expert are a third of the MLPs (routers aside)
    "prune_expert_channels": (
        "mixtral",
        {"target": {"ratio": 0.33, "of": "mlp", "tolerance": 0.01}, "stages": [{"stage": "prune_expert_channels"}]},
    ),
    "glue_finetune+pca_project_post+mask_train_encoder": ("bert", _sp3_bert(ENCODER_MASKS, 0.03)),
    # MHA-intermediate masks (heads of their own widths) and layer masks
    "mask_train_encoder-all-levels": ("bert", _sp3_bert({**ENCODER_MASKS, "intermediate": True, "layer": True}, 0.05)),
}


# Stages that need the model as a folder (distill reloads its dense teacher from the model source): they run
# from a saved tiny llama loaded in the dtype, instead of an in-memory model.
FOLDER_CASES: dict[str, dict] = {
    "prune_layer+distill": {
        "stages": [
            {"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]},
            {"stage": "distill", "args": {"steps": 2, "batch_size": 2, "seq_len": 16}},
        ]
    },
}


def _covered() -> set[str]:
    names: set[str] = set()

    def walk(stages: list[dict]) -> None:
        for stage in stages:
            if "sequential" in stage:
                walk(stage["sequential"])
            else:
                names.add(stage["stage"])

    for _model, changes in CASES.values():
        walk(changes["stages"])
    for changes in FOLDER_CASES.values():
        walk(changes["stages"])
    return names


def test_every_registered_stage_has_a_dtype_case():
    assert set(stage_names()) <= _covered(), sorted(set(stage_names()) - _covered())


def _model(kind: str, vocab_size: int) -> torch.nn.Module:
    factories = {"llama": tiny_llama, "opt": tiny_opt, "bert": tiny_bert}
    factories |= {"qwen3_moe": tiny_qwen3_moe, "mixtral": lambda vocab_size: tiny_mixtral(vocab_size, experts=8)}
    return factories[kind](vocab_size=vocab_size)


def _floating(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters() if p.is_floating_point()}


def _case_recipe(case: str, changes: dict) -> dict:
    """The recipe of ``CASES[case]`` on a model given in memory (no evaluation)."""
    return {
        "name": case,
        "model": "in-memory",
        "seed": 0,
        "calibration": CALIBRATION,
        "target": MODEL_TARGET,
        "eval": {"perplexity": None},
        **changes,
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(CASES))
def test_stage_runs_in_the_models_dtype(case, dtype, tokenizer):
    kind, changes = CASES[case]
    torch.manual_seed(0)
    model = _model(kind, len(tokenizer)).to(dtype)
    recipe = _case_recipe(case, changes)
    result = slimkit.run(recipe, model=model, tokenizer=tokenizer, evaluate=False)
    out = result.model
    wrong = {name: d for name, d in _floating(out).items() if d != dtype}
    assert not wrong, f"parameters not in {dtype}: {wrong}"
    assert result.report.as_json()["target"]["met"], result.report.as_json()["target"]
    ids = torch.randint(3, 250, (2, 12))
    if kind == "bert":
        logits = out(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    else:
        logits = model_output(out, ids)
    assert logits.dtype == dtype and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_stage_from_a_folder_runs_in_the_models_dtype(case, dtype, tiny_llama_dir):
    recipe = _case_recipe(case, FOLDER_CASES[case])
    recipe["model"] = {"source": str(tiny_llama_dir), "dtype": str(dtype).removeprefix("torch.")}
    result = slimkit.run(recipe, evaluate=False)
    wrong = {name: d for name, d in _floating(result.model).items() if d != dtype}
    assert not wrong, f"parameters not in {dtype}: {wrong}"
    assert result.report.as_json()["target"]["met"], result.report.as_json()["target"]
    logits = model_output(result.model, torch.randint(3, 250, (2, 12)))
    assert logits.dtype == dtype and torch.isfinite(logits.float()).all()


# -- lossless transforms in the model's dtype --------------------------------------------------------------


def _ids(count: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(3, 250, (count, length), generator=torch.Generator().manual_seed(1))


def _batches() -> list[torch.Tensor]:
    return list(_ids(8, 24).split(4))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rms_norm_folding_keeps_outputs_and_dtype(dtype):
    """Folding γ into the readers, compared with the same model (same dtype) before folding."""
    model = tiny_llama(tie=False).to(dtype)
    ids = _ids()
    before = model_output(model, ids).float()
    fold_rms_norms(model, tied_head="untie")
    assert set(_floating(model).values()) == {dtype}
    assert_scaled_close(model_output(model, ids).float(), before, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("tied_head", ["joint", "untie"])
def test_full_width_pca_projection_keeps_outputs_and_dtype(dtype, tied_head):
    """Group PCA at full width (norm folding, rotation, residual matrices, fusing), against the model before."""
    model = tiny_llama(layers=4).to(dtype)
    ids = _ids()
    before = model_output(model, ids).float()
    settings = ProjectionSettings(group_size=2, ratio=0.0, tied_head=tied_head)
    project_hidden_dimension(model, _batches(), settings)
    assert set(_floating(model).values()) == {dtype}
    assert_scaled_close(model_output(model, ids).float(), before, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_layernorm_to_rmsnorm_and_projection_of_opt_keep_outputs(dtype):
    """OPT: centring the writers, folding γ and β (biases), RMSNorms, then the full-width projection."""
    model = tiny_opt().to(dtype)
    ids = _ids()
    before = model_output(model, ids).float()
    converted = copy.deepcopy(model)
    layernorm_to_rmsnorm(converted)
    assert set(_floating(converted).values()) == {dtype}
    assert_scaled_close(model_output(converted, ids).float(), before, TOLERANCE[dtype])
    project_hidden_dimension(model, _batches(), ProjectionSettings(group_size=1, ratio=0.0))
    assert set(_floating(model).values()) == {dtype}
    assert_scaled_close(model_output(model, ids).float(), before, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_post_norm_projection_keeps_outputs_and_dtype(dtype):
    """BERT re-represented in one PCA basis per LayerNorm at full width, against the encoder before."""
    model = tiny_bert().to(dtype)
    ids = _ids()
    before = model_output(model, ids).float()
    project_post_norm(model, _batches(), restore_output=True)
    assert set(_floating(model).values()) == {dtype}
    assert_scaled_close(model_output(model, ids).float(), before, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_removing_zeroed_units_equals_zeroing_them(dtype):
    """Units whose down-projection columns are zero contribute nothing; removing them changes no output."""
    model = tiny_llama().to(dtype)
    group = build_groups(model, "mlp_channel", [1])[0]
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight[:, 40:].zero_()
    ids = _ids()
    before = model_output(model, ids)
    remove_units(model, group, torch.arange(40))
    assert down.weight.shape == (48, 40) and model.model.layers[1].mlp.down_proj.weight.dtype == dtype
    assert set(_floating(model).values()) == {dtype}
    assert_scaled_close(model_output(model, ids).float(), before.float(), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_save_and_load_keep_dtype_and_outputs(dtype, tmp_path, tokenizer):
    """A projected (residual matrices) and pruned model saved in its dtype and loaded back in it: same outputs.

    ``slimkit.load``'s ``dtype="auto"`` means float32 on the CPU (its documented choice), so the dtype is named."""
    model = tiny_llama(vocab_size=len(tokenizer), layers=4).to(dtype)
    project_hidden_dimension(model, _batches(), ProjectionSettings(group_size=2, ratio=0.25))
    remove_units(model, build_groups(model, "mlp_channel", [0])[0], torch.arange(0, 64, 2))
    ids = _ids()
    before = model_output(model, ids)
    slimkit.save(model, tokenizer, tmp_path / "model")
    saved: set[torch.dtype] = set()
    for path in (tmp_path / "model").glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            saved |= {weights.get_slice(key).get_dtype() for key in weights.keys()}
    assert saved == {str(dtype).removeprefix("torch.").replace("bfloat16", "BF16").replace("float32", "F32")}
    loaded, _ = slimkit.load(tmp_path / "model", dtype=str(dtype).removeprefix("torch."))
    assert set(_floating(loaded).values()) == {dtype}
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_perplexity_of_a_model_in_its_dtype(dtype, tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer)).to(dtype)
    metrics = slimkit.evaluate(model, tokenizer, perplexity=["wikitext2"], seq_len=32, max_tokens=64)
    assert math.isfinite(metrics["wikitext2_ppl"]) and set(_floating(model).values()) == {dtype}


# -- helpers --------------------------------------------------------------------------------------------------


def test_math_dtype_never_goes_below_float32():
    assert math_dtype(torch.bfloat16) == math_dtype(torch.float16) == torch.float32
    assert math_dtype(torch.float32) == torch.float32 and math_dtype(torch.float64) == torch.float64
    assert math_dtype(torch.bfloat16, torch.float64) == torch.float64 and math_dtype(torch.long) == torch.float32
    assert upcast(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_batches_follow_the_input_embeddings(device):
    model = tiny_llama().to(device=device, dtype=torch.bfloat16)
    assert input_device(model) == torch.device(device) or input_device(model).type == device
    batch = to_input_device(model, {"input_ids": _ids(), "labels": None})
    assert batch["input_ids"].device.type == device and batch["labels"] is None


def test_float_master_trains_bfloat16_weights_in_float32():
    """A learning rate below bfloat16's resolution still moves the weight through the float32 master."""
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    master = FloatMaster([weight])
    optimizer = torch.optim.SGD(master.params, lr=1e-3)
    for _ in range(10):
        weight.grad = None
        (weight.float() * 1.0).sum().backward()
        master.grads_to_master()
        optimizer.step()
        master.master_to_model()
    assert weight.dtype == torch.bfloat16 and master.params[0].dtype == torch.float32
    assert master.params[0][0].item() == pytest.approx(0.99, abs=1e-6)
    assert weight[0].item() == pytest.approx(0.99, abs=8e-3) and weight[0].item() < 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["prune-taylor", "lowrank+prune_layer", "pca_project+mask_train", "prune+lora"])
def test_stage_runs_on_cuda_in_bfloat16(case):
    tokenizer = byte_tokenizer()
    kind, changes = CASES[case]
    model = _model(kind, len(tokenizer)).to(device="cuda", dtype=torch.bfloat16)
    recipe = _case_recipe(case, changes)
    result = slimkit.run(recipe, model=model, tokenizer=tokenizer, evaluate=False)
    devices = {p.device.type for p in result.model.parameters()}
    assert devices == {"cuda"} and set(_floating(result.model).values()) == {torch.bfloat16}
    logits = model_output(result.model, _ids().cuda())
    assert torch.isfinite(logits.float()).all() and math.isfinite(float(logits.float().abs().max()))
