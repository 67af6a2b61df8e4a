"""Several GPUs (``device: auto``): which GPUs a placement spreads over, and accelerate's device map over them,
checked with simulated GPU budgets on a meta-device model (no GPU needed; real multi-GPU runs are untested)."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from slimkit.primitives.arch import ModelView
from slimkit.primitives.device.offload import module_bytes, spread_device_map
from slimkit.primitives.device.placement import spread_gpus
from slimkit.primitives.errors import SlimkitError
from tests.tiny import tiny_llama


def test_auto_spreads_over_every_visible_gpu_only_when_there_are_several():
    assert spread_gpus("auto", None, 4) == (0, 1, 2, 3)
    assert spread_gpus("auto", None, 1) == ()
    assert spread_gpus("auto", None, 0) == ()
    assert spread_gpus("cuda:1", None, 4) == ()  # a named device computes everything
    assert spread_gpus("auto", 2**30, 4) == ()  # a max_memory budget offloads instead


def _meta_model(layers: int = 8, tie: bool = True):
    config = tiny_llama(layers=layers, tie=tie).config
    with init_empty_weights():
        model = type(tiny_llama())._from_config(config, dtype=torch.float32)
    model.tie_weights()
    return model, [layer.module for layer in ModelView(model).layers]


def _layer_gpus(device_map: dict, model) -> list[int]:
    view = ModelView(model)
    names = {id(module): name for name, module in model.named_modules()}
    result = []
    for layer in view.layers:
        name = names[id(layer.module)]
        keys = [k for k in device_map if name == k or name.startswith(k + ".")]
        assert keys, f"{name} has no entry (a split layer?)"
        result.append(device_map[max(keys, key=len)])
    return result


@pytest.mark.parametrize("tie", [True, False])
def test_whole_layers_spread_in_order_over_simulated_gpus(tie):
    model, layers = _meta_model(tie=tie)
    total = module_bytes(model, torch.float32)
    device_map = spread_device_map(model, layers, {0: total, 1: total}, torch.float32)
    gpus = _layer_gpus(device_map, model)
    assert set(device_map.values()) <= {0, 1}
    assert gpus == sorted(gpus) and set(gpus) == {0, 1}  # contiguous blocks, both GPUs used (balanced)
    if tie:  # tied embedding and head stay on one GPU
        embed = next(v for k, v in device_map.items() if "embed_tokens" in k or k in ("model", ""))
        head = device_map.get("lm_head", embed)
        assert head == embed


def test_weights_beyond_the_gpus_are_refused_in_one_line():
    model, layers = _meta_model()
    quarter = module_bytes(model, torch.float32) // 4
    with pytest.raises(SlimkitError) as caught:
        spread_device_map(model, layers, {0: quarter, 1: quarter}, torch.float32)
    message = str(caught.value)
    assert "\n" not in message and "do not fit the visible GPUs" in message and "model.max_memory" in message
