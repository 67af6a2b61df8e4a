"""``mask_train``'s memory plan: what training the weights adds beside the backward's activations."""

from __future__ import annotations

from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.device.memory_model import GIB, ModelShape
from slimkit.stages.masks import MaskTrainArgs

LLAMA_8B = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                      tied=False)  # fmt: skip


def test_training_the_weights_counts_gradients_masters_and_adamw():
    # bfloat16 weights: gradients 2 bytes, float32 masters and their gradients 8, AdamW's moments 8 per parameter
    inputs = MemoryInputs(LLAMA_8B, None, 2)
    params = LLAMA_8B.total_params()
    trained = MaskTrainArgs(learning_rate=1e-5).memory("mask_train", inputs)
    frozen = MaskTrainArgs(learning_rate=0.0).memory("mask_train", inputs)
    assert set(frozen.parts) == {"activations"}
    assert trained.parts["weight gradients"] == 2 * params
    assert trained.parts["float32 masters and their gradients"] == 8 * params
    assert trained.parts["AdamW moments"] == 8 * params
    assert trained.total - frozen.total == 18 * params
    # at Llama-3.1-8B's shape the weights' training alone is about 135 GiB: no single 80 GB card holds it
    assert 130 < (trained.total - frozen.total) / GIB < 140 and frozen.total / GIB < 10
    assert trained.advice.startswith("set learning_rate: 0 to train the masks alone")


def test_float32_weights_have_no_separate_masters():
    parts = MaskTrainArgs(learning_rate=1e-5).memory("mask_train", MemoryInputs(LLAMA_8B, None, 4)).parts
    assert (
        "float32 masters and their gradients" not in parts and parts["weight gradients"] == 4 * LLAMA_8B.total_params()
    )
