"""``distill`` with ``adapter: none`` (every weight trained) end to end on a pruned tiny model, its settings refused in
one line where they cannot apply, ``sharding: fsdp`` refused in a single process before compute, and the memory
plan of full-parameter training (per device, divided among the processes under FSDP) on a hand-checkable shape."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.device.memory_model import GIB, MemoryPlan, ModelShape
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import validate
from slimkit.stages.distill import DistillArgs
from tests.recipes.test_recipes import tiny_recipe

TOKENS = 3 * 2 * 32 - 5
ARGS = {"tokens": TOKENS, "batch_size": 2, "seq_len": 32, "validation_windows": 2, "learning_rate": 1e-5}
PRUNE = {"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation", "allocation": {"global": {}}}}]}


def _recipe(model_dir, **args):
    stages = [PRUNE, {"stage": "distill", "args": {**ARGS, "adapter": "none", **args}}]
    return tiny_recipe(model_dir, target={"ratio": 0.25, "of": "mlp"}, stages=stages)


def test_every_weight_of_the_pruned_student_is_distilled(tmp_path, tiny_llama_dir):
    raw = _recipe(tiny_llama_dir)
    pruned = slimkit.run({**raw, "stages": [PRUNE]}, None, evaluate=False, compare_dense=False).model
    result = slimkit.run(raw, tmp_path / "run", evaluate=False, compare_dense=False)
    details = result.report.as_json()["stages"]["distill"]
    assert details["adapter"] == "none" and details["sharding"] == "none" and details["tokens"] == TOKENS
    assert details["trainable_params"] == sum(p.numel() for p in result.model.parameters())
    assert details["validation"][-1]["loss"] < details["validation"][0]["loss"]
    widths = [layer.mlp.up_proj.out_features for layer in result.model.model.layers]
    assert len(set(widths)) > 1  # the global ranking left each layer its own width
    before = dict(pruned.named_parameters())
    for name, param in result.model.named_parameters():
        assert param.dtype == before[name].dtype and not torch.equal(param, before[name]), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"rank": 4}, "rank: LoRA's settings; adapter: none trains every weight"),
        ({"adapter": "lora", "sharding": "fsdp"}, "sharding: fsdp shards a student trained whole; set adapter: none"),
        ({"tokens": None, "steps": 3}, "adapter: none: only with tokens"),
    ],
)
def test_settings_that_cannot_apply_are_refused_in_one_line(tmp_path, args, message):
    raw = _recipe(tmp_path, **args)
    stage_args = raw["stages"][1]["args"]
    for name, value in args.items():
        if value is None:
            stage_args.pop(name)
    if "tokens" not in stage_args:
        stage_args.pop("validation_windows")
    with pytest.raises(SlimkitError, match=message):
        validate(raw, "r.yaml")


def test_fsdp_in_one_process_is_refused_before_compute(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SlimkitError, match="sharding: fsdp shards the student over launched processes"):
        slimkit.run(_recipe(tiny_llama_dir, sharding="fsdp"), tmp_path / "run", evaluate=False, compare_dense=False)
    assert not (tmp_path / "run").exists()


SHAPE = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10, tied=True)
"""attention 4 x (2 x 4 + 2 x 2) = 48, MLP 3 x 4 x 8 = 96, norms 2 x 4: 152 a layer; embeddings 10 x 4 = 40; final
norm 4: 40 + 2 x 152 + 4 = 348 parameters."""


def test_the_memory_plan_divides_the_training_state_among_fsdp_processes(monkeypatch):
    assert SHAPE.total_params() == 348
    inputs = MemoryInputs(SHAPE, None, 4)
    args = {"tokens": 64, "batch_size": 1, "seq_len": 8, "adapter": "none"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    replicated = DistillArgs(**args).memory("distill", inputs).parts
    sharded = DistillArgs(**args, sharding="fsdp").memory("distill", inputs).parts
    assert "adapters" not in replicated
    assert replicated["student training"] == 348 * 5 * 4 == 6960  # float32 weight, gradient, 2 moments, last good
    assert sharded["student training"] == 174 * 5 * 4 == 3480  # half of each on each of the 2 processes
    # the root (embeddings 40, final norm 4) and two layers, as float32 weights and gradients
    assert sharded["gathered units"] == (40 + 4 + 2 * 152) * 2 * 4 == 2784
    # a bfloat16 student gathers in bfloat16 and reduces the larger unit's (a layer's) gradients in float32
    half = DistillArgs(**args, sharding="fsdp").memory("distill", MemoryInputs(SHAPE, None, 2)).parts
    assert half["gathered units"] == (40 + 4 + 2 * 152) * 2 * 2 + 152 * 4 == 2000
    assert replicated["teacher"] == 348 * 4  # a whole teacher on each process
    assert sharded["teacher"] == 348 * 4  # also beside a sharded student, unless teacher_sharding: fsdp
    # sharded with the student: half its weights, plus its root (embeddings 40, norm 4) and two layers gathered
    both = DistillArgs(**args, sharding="fsdp", teacher_sharding="fsdp").memory("distill", inputs).parts
    assert both["teacher"] == 348 * 4 // 2 + (40 + 4 + 2 * 152) * 4 == 2088
    for extra, fragment in (
        ({"sharding": "none"}, "teacher_sharding: fsdp needs sharding: fsdp"),
        ({"sharding": "fsdp", "teacher_max_memory": "1GiB"}, "teacher_max_memory places it otherwise"),
        ({"sharding": "fsdp", "teacher_device": "cpu"}, "teacher_device places it otherwise"),
    ):
        with pytest.raises(ValueError, match=fragment):
            DistillArgs(**args, teacher_sharding="fsdp", **extra)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert DistillArgs(**args, sharding="fsdp").memory("distill", inputs).parts["student training"] == 116 * 20
    assert GIB > sharded["student training"]


def test_a_student_trained_whole_releases_its_weights_in_the_plan(monkeypatch):
    """The float32 training state replaces the model's own weights: the plan's peak counts the stage's parts less
    the weights (348 parameters, float32 here); LoRA keeps the weights beside its adapters."""
    inputs = MemoryInputs(SHAPE, None, 4)
    args = {"tokens": 64, "batch_size": 1, "seq_len": 8}
    monkeypatch.setenv("WORLD_SIZE", "2")
    for memory in (
        DistillArgs(**args, adapter="none").memory("distill", inputs),
        DistillArgs(**args, adapter="none", sharding="fsdp").memory("distill", inputs),
    ):
        assert memory.released == 348 * 4
        plan = MemoryPlan(348 * 4, [memory])
        assert plan.peak == memory.total  # weights + parts - released
        assert plan.describe()["stages"][0]["released_gib"] == round(348 * 4 / GIB, 2)
        assert "less the weights it releases" in (plan.refusal("cpu", 0) or "")
    lora = DistillArgs(**args).memory("distill", inputs)
    assert lora.released == 0 and MemoryPlan(348 * 4, [lora]).peak == 348 * 4 + lora.total


def test_a_sharded_student_gathered_back_can_set_the_peak(monkeypatch):
    """Over many processes the shards are small and the end sets the peak: the whole model gathered back in its
    dtype (the plan's weights line) beside this process's float32 shards and the teacher."""
    deep = ModelShape(hidden=32, intermediate=64, layers=40, heads=4, kv_heads=2, head_dim=8, vocab=10, tied=True)
    params = deep.total_params()
    # a layer: attention 32 x (2 x 32 + 2 x 16), MLP 3 x 32 x 64, two norms of 32; embeddings 10 x 32; final norm
    assert params == 40 * (3072 + 6144 + 64) + 320 + 32 == 371552
    monkeypatch.setenv("WORLD_SIZE", "64")
    args = DistillArgs(tokens=64, batch_size=1, seq_len=2, adapter="none", sharding="fsdp", teacher_sharding="fsdp")
    memory = args.memory("distill", MemoryInputs(deep, None, 4))
    assert memory.released == 0
    # the teacher sharded too: 1/64 of it, its root (embeddings, final norm) and two layers gathered
    teacher = params * 4 // 64 + (320 + 32 + 2 * 9280) * 4
    assert memory.parts == {"float32 shards while gathering back": 5806 * 4, "teacher": teacher}
    monkeypatch.setenv("WORLD_SIZE", "2")  # over two processes, training sets the peak
    assert args.memory("distill", MemoryInputs(deep, None, 4)).released == params * 4


def test_an_offloaded_teacher_teaches_exactly_what_a_resident_one_does(tmp_path, tiny_llama_dir):
    """``teacher_max_memory``: the teacher's decoder layers outside the budget are offloaded (to disk on a CPU) and
    moved in for each forward; its logits, so the distilled student, are the resident teacher's."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    layer = sum(p.numel() for p in dense.model.layers[0].parameters()) * 4
    resident = sum(p.numel() for p in dense.parameters()) * 4 - len(dense.model.layers) * layer  # embeddings, norm
    budget = f"{resident + int(layer * 1.5)}B"  # room for one decoder layer and a half: the others on disk
    from slimkit.primitives.io.model_sources import load_source

    teacher, _tokenizer, _info = load_source(str(tiny_llama_dir), device="cpu", dtype="float32", max_memory=budget)
    assert list(teacher.hf_device_map.values()).count("disk") == len(dense.model.layers) - 1
    del teacher
    raw = _recipe(tiny_llama_dir)
    offloaded = _recipe(tiny_llama_dir, teacher_max_memory=budget)
    resident = slimkit.run(raw, None, evaluate=False, compare_dense=False)
    result = slimkit.run(offloaded, None, evaluate=False, compare_dense=False)
    details = result.report.as_json()["stages"]["distill"]
    assert details["teacher_offloaded"] is True
    assert details["losses"] == resident.report.as_json()["stages"]["distill"]["losses"]
    expected = dict(resident.model.named_parameters())
    for name, param in result.model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_the_teacher_placement_is_checked_and_planned(monkeypatch):
    inputs = MemoryInputs(SHAPE, None, 4, device="cpu")
    args = {"tokens": 64, "batch_size": 1, "seq_len": 8}
    assert DistillArgs(**args).memory("distill", inputs).parts["teacher"] == 348 * 4
    assert "teacher" not in DistillArgs(**args, teacher_device="cuda:1").memory("distill", inputs).parts
    assert DistillArgs(**args, teacher_device="cpu").memory("distill", inputs).parts["teacher"] == 348 * 4
    on_gpu = MemoryInputs(SHAPE, None, 4, device="cuda:0")
    assert "teacher" in DistillArgs(**args, teacher_device="cuda").memory("distill", on_gpu).parts  # cuda is cuda:0
    unknown = MemoryInputs(SHAPE, None, 4)  # the device not known: counted
    assert "teacher" in DistillArgs(**args, teacher_device="cuda:1").memory("distill", unknown).parts
    # offloaded within 400 bytes: the budget and one layer moved in (152 of 348 parameters: 608 bytes)
    offloaded = DistillArgs(**args, teacher_max_memory="400B").memory("distill", inputs).parts["teacher"]
    assert offloaded == 400 + 348 * 4 * 152 // 348 == 1008
    assert DistillArgs(**args, teacher_max_memory="1GiB").memory("distill", inputs).parts["teacher"] == 348 * 4
    for bad, fragment in (({"teacher_device": "gpu"}, "teacher_device"), ({"teacher_max_memory": "lots"}, "size")):
        with pytest.raises(ValueError, match=fragment):
            DistillArgs(**args, **bad)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SlimkitError, match="teacher_device cuda:1 would put every launched process's teacher"):
        DistillArgs(**args, teacher_device="cuda:1").check_model(None)
