"""LoRA recovery: the loss falls, merging is lossless, steps=0 is a no-op, targets are checked,
and a pruned model with per-layer widths trains, merges and round-trips through save/load."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slimkit
from slimkit.primitives import surgery
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune import LoraConfig, lora_recover, merge_lora, train_lora
from tests.tiny import model_output, tiny_llama, tiny_opt

FAST = {"batch_size": 2, "seq_len": 32, "dataset": "alpaca"}


def _prune_mlp(model, layer, width):
    surgery.prune_layer(model, "mlp_channel", layer, torch.arange(width))


def _no_peft(model):
    names = {type(m).__module__ for m in model.modules()}
    return not any(n.startswith("peft") for n in names) and not hasattr(model, "peft_config")


def test_loss_goes_down(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    seen = []
    config = LoraConfig(rank=4, steps=30, learning_rate=1e-2, dropout=0.0, **FAST)
    merged, report = lora_recover(model, tokenizer, config, progress=seen.append)
    assert merged is model and _no_peft(model) and not model.training
    assert seen == list(range(1, 31)) and len(report["losses"]) == 30
    losses = report["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1  # about 5.50 -> 5.34 here
    assert report["loss_first"] == losses[0] and report["loss_last"] == losses[-1]
    assert report["tokens"] == 30 * 2 * 32 and report["config"]["rank"] == 4
    # rank 4 on q,k,v,o,gate,up,down of 3 layers (hidden 48, kv 16, mlp 64)
    per_layer = 4 * ((48 + 48) * 2 + (48 + 16) * 2 + (48 + 64) * 3)
    assert report["trainable_params"] == 3 * per_layer
    assert all(p.requires_grad for p in model.parameters())


def test_merge_is_lossless_and_training_is_deterministic(tokenizer):
    ids = torch.randint(3, len(tokenizer), (2, 16))
    config = LoraConfig(rank=4, steps=3, learning_rate=1e-2, **FAST)
    base = tiny_llama(vocab_size=len(tokenizer))
    runs = []
    for _ in range(2):
        model = copy.deepcopy(base)
        torch.manual_seed(123)  # the run is seeded by config.seed, not by the global RNG
        training = train_lora(model, tokenizer, config)
        wrapped = model_output(training.peft_model, ids)
        merged = merge_lora(training)
        assert _no_peft(merged)
        torch.testing.assert_close(model_output(merged, ids), wrapped, rtol=1e-5, atol=1e-5)
        runs.append((training.report["losses"], merged.state_dict()))
    assert runs[0][0] == runs[1][0]
    for key, value in runs[0][1].items():
        assert torch.equal(value, runs[1][1][key]), key


def test_zero_steps_leaves_the_model_unchanged(llama, tokenizer):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    model, report = lora_recover(llama, tokenizer, LoraConfig(steps=0))
    assert model is llama and _no_peft(model)
    assert report["losses"] == [] and report["loss_first"] is None and report["tokens"] == 0
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_target_name_shared_by_dense_and_low_rank_layers_is_refused_and_full_paths_pass(tokenizer):
    from slimkit.primitives.finetune.lora import check_targets
    from slimkit.primitives.lowrank import LowRankLinear

    model = tiny_llama(vocab_size=len(tokenizer))
    attention = model.model.layers[1].self_attn
    attention.q_proj = LowRankLinear.from_linear(attention.q_proj, 4)
    with pytest.raises(SlimkitError, match="'q_proj' names a LowRankLinear, not only Linear layers"):
        check_targets(model, ("q_proj",))
    check_targets(model, ("model.layers.0.self_attn.q_proj", "model.layers.2.self_attn.q_proj", "first", "second"))


def test_unknown_target_module_is_a_user_error(tokenizer):
    model = tiny_opt(vocab_size=len(tokenizer))
    with pytest.raises(SlimkitError, match=r"lora target module 'o_proj' not in the model; found: .*out_proj"):
        lora_recover(model, tokenizer, LoraConfig(steps=1, **FAST))
    with pytest.raises(SlimkitError, match="names a OPTAttention, not only Linear layers"):
        lora_recover(model, tokenizer, LoraConfig(steps=1, target_modules=("self_attn",), **FAST))
    assert _no_peft(model)
    with pytest.raises(SlimkitError, match="rank must be >= 1"):
        LoraConfig(rank=0)
    opt_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    _, report = lora_recover(model, tokenizer, LoraConfig(steps=1, target_modules=opt_targets, **FAST))
    assert _no_peft(model) and len(report["losses"]) == 1


def test_pruned_model_with_per_layer_widths_trains_and_round_trips(tmp_path, tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    for index, width in enumerate((40, 24, 56)):
        _prune_mlp(model, index, width)
    model, _ = lora_recover(model, tokenizer, LoraConfig(rank=4, steps=2, learning_rate=1e-2, **FAST))
    assert _no_peft(model) and all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert [layer.mlp_width for layer in ModelView(model).layers] == [40, 24, 56]
    ids = torch.randint(3, len(tokenizer), (2, 16))
    expected = model_output(model, ids)
    slimkit.save(model, tokenizer, tmp_path / "out")
    loaded, _ = slimkit.load(tmp_path / "out")
    assert [layer.mlp_width for layer in ModelView(loaded).layers] == [40, 24, 56]
    torch.testing.assert_close(model_output(loaded, ids), expected, rtol=0, atol=0)


def test_a_failed_run_removes_the_adapters_without_merging(llama, tokenizer):
    before = {k: v.clone() for k, v in llama.state_dict().items()}

    def interrupt(step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lora_recover(llama, tokenizer, LoraConfig(steps=2, learning_rate=1e-2, **FAST), progress=interrupt)
    assert _no_peft(llama) and all(p.requires_grad for p in llama.parameters())
    assert all(torch.equal(llama.state_dict()[k], v) for k, v in before.items())
