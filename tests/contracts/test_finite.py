"""NaN and inf never reach a saved model: recipe fields refuse them, training loops catch a divergence
after the last update too, and :func:`slimkit.save` refuses non-finite weights before writing anything."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from pydantic import ValidationError

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune import LoraConfig, lora_recover, merge_lora, train_lora
from slimkit.primitives.io.save import non_finite_tensors
from slimkit.primitives.masks.mask_settings import StreamMaskSettings
from slimkit.primitives.masks.stream import train_stream_masks
from slimkit.primitives.masks.training import MaskTarget
from slimkit.recipes.loading import load_recipe, validate
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import byte_tokenizer, tiny_llama

FAST_LORA = {"steps": 1, "batch_size": 2, "seq_len": 16}
SMALL = [
    "calibration.samples=2",
    "calibration.seq_len=16",
    "calibration.batch_size=2",
    "target.tolerance=0.2",
    "eval.perplexity=null",
    "stages.1.args.steps=1",
    "stages.1.args.batch_size=2",
    "stages.1.args.seq_len=16",
]


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def _lora_recipe(model_dir, **lora) -> dict:
    return tiny_recipe(
        model_dir, target={"ratio": 0.0}, stages=[{"stage": "lora", "args": {**FAST_LORA, **lora}}], eval={}
    )


# --- recipe fields --------------------------------------------------------------------------------------


def test_the_issue_command_is_refused_naming_the_field(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    args = ["recipe", "run", "lorap", "--set", f"model={tiny_llama_dir}", *(f"--set={s}" for s in SMALL)]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--set", "stages.1.args.learning_rate=.inf", "--out", str(out))
    assert_one_line_error(code, err, "stages.1: args.learning_rate: must be a finite number, got inf")
    assert not out.exists()


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("target.ratio=.nan", "target.ratio"),
        ("target.ratio=.inf", "target.ratio"),
        ("target.tolerance=.nan", "target.tolerance"),
        ("calibration.samples=.inf", "calibration.samples"),
        ("calibration.samples=.nan", "calibration.samples"),
        ("stages.1.args.learning_rate=.inf", "stages.1: args.learning_rate"),
        ("stages.1.args.learning_rate=.nan", "stages.1: args.learning_rate"),
        ("stages.1.args.alpha=.inf", "stages.1: args.alpha"),
        ("stages.0.sequential.0.args.ratio=.nan", "stages.0.sequential.0: args.ratio"),
        ("stages.0.sequential.1.args.ratio=.inf", "stages.0.sequential.1: args.ratio"),
        ("stages.0.sequential.1.args.protect_lowest=.nan", "stages.0.sequential.1: args.protect_lowest"),
        ("stages.0.sequential.0.args.qk_share=.nan", "stages.0.sequential.0: args.qk_share"),
        ("model.max_memory=.inf", "model.max_memory"),
        ("eval.perplexity.max_tokens=.inf", "eval.perplexity.max_tokens"),
    ],
)
def test_inf_and_nan_fields_give_one_line_naming_the_field(override, field):
    with pytest.raises(SlimkitError) as error:
        load_recipe("lorap", [override])
    message = _one_line(error)
    assert f"{field}: must be a finite number, got " in message, message
    assert ";" not in message.partition(f"{field}: ")[2], message  # one problem, not one per union member


@pytest.mark.parametrize(
    ("stage", "field"),
    [
        ({"stage": "mask_train", "args": {"learning_rate": math.nan}}, "learning_rate"),
        ({"stage": "mask_train", "args": {"mask_learning_rate": math.inf}}, "mask_learning_rate"),
        ({"stage": "prunenet", "args": {"ratio": math.nan}}, "ratio"),
        ({"stage": "prunenet", "args": {"gamma": math.nan}}, "gamma"),
        ({"stage": "pca_project", "args": {"ratio": math.nan}}, "ratio"),
        ({"stage": "cce", "args": {"lora_alpha": math.inf}}, "lora_alpha"),
        (
            {"stage": "prune", "args": {"scorer": {"blend": {"activation": math.inf, "taylor": 1}}}},
            "scorer: blend.activation",
        ),
        ({"stage": "prune", "args": {"scorer": {"platon": "activation", "x1": math.nan}}}, "scorer: x1"),
    ],
)
def test_every_stage_argument_refuses_inf_and_nan(tmp_path, stage, field):
    with pytest.raises(SlimkitError) as error:
        validate(tiny_recipe(tmp_path, target={"ratio": 0.2}, stages=[stage]), "r.yaml")
    assert f"stages.0: args.{field}: must be a finite number, got " in _one_line(error)


def test_a_nan_target_ratio_says_finite_not_less_than_one(tmp_path):
    with pytest.raises(SlimkitError) as error:
        validate(tiny_recipe(tmp_path, target={"ratio": math.nan}), "r.yaml")
    message = _one_line(error)
    assert "target.ratio: must be a finite number, got nan" in message and "less than" not in message


def test_primitive_configs_refuse_inf_and_nan():
    with pytest.raises(SlimkitError, match="learning_rate must be a finite number"):
        LoraConfig(learning_rate=math.inf)
    with pytest.raises(ValidationError, match="rank_prior"):
        StreamMaskSettings(rank_prior=math.nan)
    with pytest.raises(ValidationError, match="learning_rate"):
        StreamMaskSettings(learning_rate=math.nan)
    with pytest.raises(SlimkitError, match=r"target must be in \(0, 1\), got nan"):
        MaskTarget(math.nan, 100)


# --- training divergence ----------------------------------------------------------------------------------


def test_a_huge_lora_learning_rate_is_refused_before_compute(tmp_path, tiny_llama_dir):
    """A finite but huge learning rate (one step of it makes the weights useless; the divergence checks below catch
    that inside the trainer) is refused by the recipe's bound before anything runs, and nothing is written."""
    raw = _lora_recipe(tiny_llama_dir, learning_rate=1e30)
    out = tmp_path / "run"
    with pytest.raises(SlimkitError) as error:
        slimkit.run(raw, out, evaluate=False)
    message = _one_line(error)
    assert message == "recipe: stages.0: args.learning_rate: Input should be less than or equal to 1"
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]


@pytest.mark.parametrize("steps", [1, 3])
def test_lora_loss_nan_after_the_last_update_is_caught_and_nothing_is_merged(tokenizer, steps):
    model = tiny_llama(vocab_size=len(tokenizer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = LoraConfig(**{**FAST_LORA, "steps": steps}, learning_rate=1e30)
    with pytest.raises(SlimkitError) as error:
        lora_recover(model, tokenizer, config)
    message = _one_line(error)
    # one step: its loss was finite, only the check after the loop sees the result; more: the next step's loss
    assert message.startswith(f"lora training diverged at step {min(steps, 2)}: loss nan"), message
    assert message.endswith("; lower learning_rate (got 1e+30)")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_lora_inf_learning_rate_given_directly_is_caught_after_the_last_update(tokenizer):
    """Past the config check (as a caller building the dataclass without it would be): the step's loss is
    finite, the update makes the adapters NaN; the check after the loop catches it."""
    model = tiny_llama(vocab_size=len(tokenizer))
    config = LoraConfig(**FAST_LORA)
    object.__setattr__(config, "learning_rate", math.inf)
    with pytest.raises(SlimkitError) as error:
        lora_recover(model, tokenizer, config)
    assert _one_line(error).startswith("lora training diverged at step 1: ")
    assert not non_finite_tensors(model)[0]


def test_a_merge_that_overflows_is_refused_and_the_model_left_as_it_was(tokenizer):
    """Finite adapters whose update overflows once multiplied out (B A scaled): nothing is merged."""
    model = tiny_llama(vocab_size=len(tokenizer))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    training = train_lora(model, tokenizer, LoraConfig(**FAST_LORA))
    wrapped = training.peft_model.base_model.model.model.layers[1].mlp.up_proj
    with torch.no_grad():
        wrapped.lora_B["default"].weight.fill_(1e38)
        wrapped.lora_A["default"].weight.fill_(1.0)
    with pytest.raises(SlimkitError) as error:
        merge_lora(training)
    assert _one_line(error) == (
        "lora training diverged at step 1: merging the adapters makes 1 weights NaN/inf "
        "(model.layers.1.mlp.up_proj); lower learning_rate (got 0.0001)"
    )
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_mask_training_diverging_at_the_last_update_is_caught(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    total = sum(p.numel() for p in model.parameters())
    settings = StreamMaskSettings(mask_steps=1, hidden=False).model_copy(update={"learning_rate": math.inf})
    batches = [torch.randint(3, len(tokenizer), (2, 16))]
    with pytest.raises(SlimkitError) as error:
        train_stream_masks(model, batches, settings, MaskTarget(0.2, total))
    message = _one_line(error)
    assert message.startswith("mask training diverged at step 1: ") and "NaN/inf after the update" in message


# --- saving -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_refuses_nan_weights_and_writes_nothing(tmp_path, tokenizer, dtype):
    model = tiny_llama(vocab_size=len(tokenizer)).to(dtype)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = math.nan
        model.model.layers[2].self_attn.o_proj.weight[0, 0] = -math.inf
    target = tmp_path / "out"
    with pytest.raises(SlimkitError) as error:
        slimkit.save(model, tokenizer, target)
    bad, checked = non_finite_tensors(model)
    assert bad == ["model.layers.0.mlp.up_proj.weight", "model.layers.2.self_attn.o_proj.weight"]
    assert _one_line(error) == (
        f"2 of {checked} tensors hold NaN/inf (model.layers.0.mlp.up_proj.weight, "
        "model.layers.2.self_attn.o_proj.weight); nothing was written"
    )
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = 0.0
        model.model.layers[2].self_attn.o_proj.weight[0, 0] = 0.0
    slimkit.save(model, tokenizer, target)
    assert (target / "config.json").is_file()


def test_save_checks_big_tensors_in_chunks(monkeypatch, tmp_path, tokenizer):
    finite_module = importlib.import_module("slimkit.primitives.io.finite")  # the check save() calls
    monkeypatch.setattr(finite_module, "CHECK_CHUNK", 100)  # every weight is checked a few rows at a time
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[-1, -1] = math.inf  # in the last chunk
    with pytest.raises(
        SlimkitError, match=r"^1 of \d+ tensors hold NaN/inf \(model\.layers\.1\.mlp\.down_proj\.weight\)"
    ):
        slimkit.save(model, tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_reads_offloaded_weights_to_check_them(tmp_path):
    """An accelerate-offloaded model keeps its offloaded weights on the meta device; the check reads each
    from the weights map, as save_pretrained does, and finds a NaN there."""
    from tests.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    source = tmp_path / "tiny4"
    tiny_llama(vocab_size=len(tokenizer), layers=4).save_pretrained(source, max_shard_size="30KB")
    tokenizer.save_pretrained(source)
    model, _ = slimkit.load(source, max_memory="200KB")
    meta = [name for name, t in model.state_dict().items() if t.device.type == "meta"]
    assert "disk" in model.hf_device_map.values() and meta
    assert non_finite_tensors(model)[0] == []
    slimkit.save(model, tokenizer, tmp_path / "good")  # finite offloaded weights save as before
    assert (tmp_path / "good" / "config.json").is_file()

    name = meta[-1]
    module_path, _, leaf = name.rpartition(".")
    weights_map = model.get_submodule(module_path)._hf_hook.weights_map  # accelerate's PrefixedDataset
    loader = weights_map.dataset  # OffloadedWeightsLoader: in-memory entries are read before the disk files
    value = weights_map[leaf].clone()
    value.view(-1)[0] = math.nan
    loader.state_dict[weights_map.prefix + leaf] = value
    with pytest.raises(SlimkitError, match=rf"^1 of \d+ tensors hold NaN/inf \({name}\); nothing was written$"):
        slimkit.save(model, tokenizer, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "tiny4"]


def test_a_run_without_an_output_folder_refuses_nan_weights_after_the_stages(tiny_llama_dir, monkeypatch):
    """The Python API without ``out`` never saves, so the runner checks the weights itself after the stages."""
    from slimkit.engine import runner

    original = runner.run_stages

    def poisoned(ctx, *args, **kwargs):
        shares = original(ctx, *args, **kwargs)
        with torch.no_grad():
            ctx.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
        return shares

    monkeypatch.setattr(runner, "run_stages", poisoned)
    raw = tiny_recipe(tiny_llama_dir)
    with pytest.raises(SlimkitError, match=r"1 of \d+ tensors hold NaN/inf after the stages \(model\.layers\.0\.mlp"):
        slimkit.run(validate(raw, "t"), evaluate=False)


def test_perplexity_of_an_encoder_is_refused_before_compression(tmp_path):
    from tests.tiny import tiny_bert

    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    raw = tiny_recipe(folder, stages=[{"stage": "prune", "args": {"scorer": "magnitude"}}])
    with pytest.raises(SlimkitError, match=r"eval\.perplexity: needs a causal language model"):
        slimkit.run(raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()
