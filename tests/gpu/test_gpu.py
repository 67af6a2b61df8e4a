"""The GPU tier (marker ``gpu``; skipped without CUDA, so CI on CPU skips it): recipes on CUDA in bfloat16.

Run on a GPU machine with ``python -m pytest -q -m gpu``. Checks that the bundled LLM recipes run on the
device the model is on, in bfloat16, without moving or casting it; that an offloaded model (layers in
CPU memory, one layer at a time on the GPU) compresses to the in-memory result; and LoRAP on the real
smollm2-135m in bfloat16 against its float32 CPU perplexity.
"""

from __future__ import annotations

import math

import pytest
import torch

import slimkit
from tests.primitives.device.test_device import LORAP, _recipe
from tests.tiny import model_output

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GPU = {"device": "cuda", "dtype": "bfloat16"}
STAGES = {
    "lorap": [LORAP],
    "wanda-channels": [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}],
    "wanda-channels+reconstruct": [
        {"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}, {"stage": "reconstruct"}]}
    ],
    "llm-pruner": [{"stage": "prune", "args": {"groups": ["attention_head", "mlp_channel"], "scorer": "taylor"}}],
    # the lean gradient statistics on CUDA: float32 sums in host memory, layers recomputed in the backward
    "llm-pruner-stats-cpu": [
        {
            "stage": "prune",
            "args": {
                "groups": ["attention_head", "mlp_channel"],
                "scorer": "taylor",
                "order": "second",
                "stats_device": "cpu",
                "checkpoint_layers": True,
            },
        }
    ],
    "cce": [{"stage": "cce", "args": {"kinds": ["mlp_channel"], "scorer": "magnitude", "iterations": 2}}],
    "cce-coupled": [{"stage": "cce", "args": {"scorer": "coupled", "iterations": 2}}],
    "cce-coupled-full": [
        {"stage": "cce", "args": {"scorer": "coupled", "gradients": "full", "iterations": 2, "stats_device": "cpu"}}
    ],
    "sp3-oneshot": [{"stage": "pca_project", "args": {"group_size": "all"}}],
    # layer groups: Eq. 34 boundaries and residual matrices between groups (a CPU identity once met CUDA bases)
    "sp3-oneshot-groups": [{"stage": "pca_project", "args": {"group_size": 1}}],
    "prunenet": [{"stage": "prunenet", "args": {"episodes": 1, "save_policy": False}}],
}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_recipe_runs_on_cuda_in_bfloat16(tiny_llama_dir, name):
    result = slimkit.run(_recipe({"source": str(tiny_llama_dir), **GPU}, STAGES[name]))
    placement = result.report.as_json()["placement"]
    assert placement["device"].startswith("cuda") and placement["dtype"] == "bfloat16"
    assert placement["gpu"] and placement["peak_gpu_mb"] > 0
    assert {p.device.type for p in result.model.parameters()} == {"cuda"}
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}
    assert result.report.as_json()["target"]["met"], result.report.as_json()["target"]
    ids = torch.randint(3, 200, (2, 16), device="cuda")
    assert torch.isfinite(model_output(result.model, ids)).all()


def test_cpu_offload_on_cuda_equals_in_memory(tmp_path, tokenizer):
    from tests.tiny import tiny_llama

    path = tmp_path / "tiny4"
    tiny_llama(vocab_size=len(tokenizer), layers=4).save_pretrained(path, max_shard_size="30KB")
    tokenizer.save_pretrained(path)
    settings = {"source": str(path), "device": "cuda", "dtype": "float32"}
    dense = slimkit.run(_recipe(settings))
    offloaded = slimkit.run(_recipe({**settings, "max_memory": "200KB"}))
    assert "cpu" in offloaded.model.hf_device_map.values()
    ids = torch.randint(3, 200, (2, 16), device="cuda")
    torch.testing.assert_close(model_output(offloaded.model, ids), model_output(dense.model, ids))


@pytest.mark.real
def test_lorap_on_smollm2_in_bfloat16():
    # LoRAP without recovery at 20%: float32 on the CPU gives WikiText-2 perplexity 81.1 on 8,192 tokens
    # (README); bfloat16 on CUDA rounds differently, so this allows 10% either way.
    overrides = [
        "model.device=cuda",
        "model.dtype=bfloat16",
        "stages.1.args.steps=0",
        "eval.perplexity.datasets=[wikitext2]",
        "eval.perplexity.max_tokens=8192",
        "eval.zeroshot=null",
    ]
    result = slimkit.run("lorap", overrides=overrides)
    ppl = result.report.as_json()["metrics"]["wikitext2_ppl"]
    assert math.isfinite(ppl)
    assert ppl == pytest.approx(81.1, rel=0.1)


def test_evaluation_on_cuda_matches_cpu():
    # Perplexity and lm-eval zero-shot run where the model is; in float32 the CUDA numbers equal the CPU ones
    # up to summation order (a near-tie in a 4-way choice may flip one answer of 8).
    from slimkit.primitives.evaluate.perplexity import perplexity
    from slimkit.primitives.evaluate.zeroshot import evaluate_zeroshot
    from tests.primitives.evaluate.test_zeroshot import _tiny_model_and_tokenizer

    model, tokenizer = _tiny_model_and_tokenizer()
    tasks = ["piqa", "boolq", "hellaswag"]
    on_cpu = perplexity(model, tokenizer, "wikitext2", seq_len=64, max_tokens=512).perplexity
    choices_cpu = evaluate_zeroshot(model, tokenizer, tasks, limit=8, batch_size=4)
    model.to("cuda")
    on_cuda = perplexity(model, tokenizer, "wikitext2", seq_len=64, max_tokens=512).perplexity
    choices_cuda = evaluate_zeroshot(model, tokenizer, tasks, limit=8, batch_size=4)
    assert on_cuda == pytest.approx(on_cpu, rel=1e-4)
    for task in tasks:
        assert choices_cuda[task]["n"] == 8
        assert abs(choices_cuda[task]["acc"] - choices_cpu[task]["acc"]) <= 1 / 8, task


def test_lean_gradient_sums_on_cuda_match_and_use_less_memory():
    from slimkit.primitives.calibration.gradients import accumulate_gradients
    from slimkit.primitives.groups import build_groups
    from slimkit.primitives.importance import member_tensors
    from tests.tiny import tiny_llama

    model = tiny_llama(layers=4).to("cuda", torch.bfloat16)
    batches = [torch.randint(3, 200, (4, 64)) for _ in range(2)]
    scored = list(member_tensors(model, build_groups(model, "mlp_channel", [1, 2])))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    full = accumulate_gradients(model, batches)  # every parameter, both moments
    full_peak = torch.cuda.max_memory_allocated() - base
    full_sums = {id(t): full.of(t)[0].clone() for t in scored}
    del full
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lean = accumulate_gradients(model, batches, tensors=scored, squares=False)
    lean_peak = torch.cuda.max_memory_allocated() - base
    for tensor in scored:
        torch.testing.assert_close(lean.of(tensor)[0], full_sums[id(tensor)])
        assert lean.of(tensor)[0].is_cuda and lean.of(tensor)[0].dtype == torch.float32
    assert lean_peak < full_peak, (lean_peak, full_peak)
    on_host = accumulate_gradients(model, batches, tensors=scored, squares=False, stats_device="cpu")
    for tensor in scored:
        assert on_host.grad[id(tensor)].device.type == "cpu"  # where the sums live
        assert on_host.of(tensor)[0].is_cuda  # read on the scored tensor's device
        torch.testing.assert_close(on_host.of(tensor)[0], full_sums[id(tensor)])
