"""Memory plans of the MoE recipes at the real shapes of GPT-OSS-20B, DeepSeek-V3 and Kimi K2, made on the CPU.

    python -m benchmarks.moe_plans                  # writes benchmarks/results/<date>-moe-plans.{json,md}

No weights exist here and nothing of the model's size is allocated: each model is built from its public
``config.json`` values on PyTorch's meta device (shapes without storage), its exact parameter count read from that, and
each recipe's memory plan made as ``slimkit recipe run`` makes it before loading (:func:`slimkit.engine.memory_check.
recipe_memory_plan`: the weights from :class:`~slimkit.primitives.device.memory_model.ModelShape` plus each stage's
estimate beside them), in bfloat16 on a CUDA device. One DeepSeek-V3-shaped layer is also measured: its parameters
and one expert-pruning search's working set at the stage's default 1,024 tokens. A plan is not a measurement of a
run; a GPU run (``benchmarks/moe_scale.py``, one layer of real width with random weights) measures one.
Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.engine_calls import memory_plan
from benchmarks.core.outputs import RESULTS, dated_base, write_results

RECIPES = ("moe-expert-prune", "moe-expert-prune+channels", "moe-expert-merge", "wanda-channels")
STATEMENT = "Plans from configs on the meta device: no weights, no run; a GPU run measures one layer."

# config.json values of openai/gpt-oss-20b, deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct (the fields a
# shape reads; the others keep transformers' defaults).
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
        "sliding_window": 128,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
    },
}
CONFIGS["kimi-k2"] = {
    **CONFIGS["deepseek-v3"],
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 163840,
}
CONFIGS["deepseek-v3-layer"] = {**CONFIGS["deepseek-v3"], "num_hidden_layers": 4}
"""Four layers: three dense (first_k_dense_replace) and one routed, the routed one reported per layer."""


def config(name: str) -> Any:
    from transformers import AutoConfig

    values = dict(CONFIGS[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def exact_params(cfg: Any) -> tuple[int, int | None]:
    """The meta-built model's parameters, and one routed layer's (None for a model without one)."""
    import torch
    from transformers import AutoModelForCausalLM

    from slimkit.primitives.arch.moe import moe_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    blocks = moe_blocks(model)
    layer = sum(p.numel() for p in blocks[-1].layer.parameters()) if blocks else None
    return sum(p.numel() for p in model.parameters()), layer


def plans(name: str) -> dict[str, Any]:
    import torch

    from slimkit.primitives.device.memory_model import GIB, ModelShape
    from slimkit.recipes.loading import load_recipe, validate

    cfg = config(name)
    shape = ModelShape.from_config(cfg)
    exact, layer = exact_params(cfg)
    row: dict[str, Any] = {
        "model": name,
        "params_exact": exact,
        "params_planned": shape.total_params(),
        "routed_layer_params": layer,
        "weights_bf16_gib": round(shape.total_params() * 2 / GIB, 2),
        "plans": {},
    }
    for recipe_name in RECIPES:
        _, raw = load_recipe(recipe_name)
        raw["model"] = "smollm2-135m"  # the plan reads the given config, not the source
        plan = memory_plan(validate(raw, recipe_name), cfg, torch.bfloat16, torch.device("cuda"))
        peak = plan.peak_stage
        row["plans"][recipe_name] = {
            "peak_gib": round(plan.peak / GIB, 2),
            "beside_weights_gib": round((plan.peak - plan.weights) / GIB, 2),
            "peak_stage": None if peak is None else peak.stage,
            "parts_gib": {} if peak is None else {k: round(v / GIB, 3) for k, v in peak.parts.items()},
        }
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# MoE memory plans ({result['date']})",
        "",
        result["statement"],
        "",
        "| model | params (meta-built) | params (plan) | weights bf16 GiB | recipe | plan peak GiB | beside weights |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for row in result["rows"]:
        for recipe, plan in row["plans"].items():
            lines.append(
                f"| {row['model']} | {row['params_exact']:,} | {row['params_planned']:,} | {row['weights_bf16_gib']} "
                f"| {recipe} | {plan['peak_gib']} | {plan['beside_weights_gib']} |"
            )
    return "\n".join(lines) + "\n"


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.moe_plans", __doc__)
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_output_folder("--out", "the results", default=RESULTS, help="folder of the dated .json and .md")
    args = parser.parse(argv)
    date = dt.date.today().isoformat()
    result = {"date": date, "statement": STATEMENT, "rows": [plans(name) for name in args.models]}
    text = markdown(result)
    write_results(dated_base(args.out, "moe-plans"), result, text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
