"""The bundled recipes as the benchmarks sort them: which compress a causal LM, which need a mixture-of-experts
model, and their stages with the recovery ones left out.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from typing import Any

RECOVERY_STAGES = frozenset({"lora", "distill"})
"""Recovery training after the compression: a cost run drops it, a grid row "without recovery" runs it for 0 steps."""
MOE_STAGES = frozenset({"prune_experts", "merge_experts", "prune_expert_channels"})
"""Stages of mixture-of-experts recipes: those run on an MoE model."""


def flat_stages(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A parsed recipe's stage entries, those inside a ``sequential`` block in its place."""
    stages = raw.get("stages") or []
    return [child for item in stages if isinstance(item, dict) for child in (item.get("sequential") or [item])]


def without_stages(items: list[Any], names: frozenset[str], dropped: list[str]) -> list[Any]:
    """``items`` (a recipe's ``stages``) without the stages named in ``names``, inside ``sequential`` blocks too;
    the names dropped are appended to ``dropped``."""
    kept = []
    for item in items:
        if isinstance(item, dict) and item.get("stage") in names:
            dropped.append(item["stage"])
        elif isinstance(item, dict) and "sequential" in item:
            kept.append({**item, "sequential": without_stages(item["sequential"], names, dropped)})
        else:
            kept.append(item)
    return kept


def llm_recipes() -> dict[str, str | None]:
    """Every bundled recipe name -> None for a recipe that compresses a causal LM, or why it does not (a GLUE task
    model, an encoder)."""
    from slimkit.recipes.loading import bundled_recipes, load_recipe

    names: dict[str, str | None] = {}
    for name in sorted(bundled_recipes()):
        _, raw = load_recipe(name)
        model = raw.get("model")
        source = model.get("source") if isinstance(model, dict) else model
        if raw.get("task") is not None:
            names[name] = f"a GLUE task model (task: {raw['task']})"
        elif source == "minilm-l6":
            names[name] = "an encoder (minilm-l6)"
        else:
            names[name] = None
    return names


def causal_lm_recipes() -> list[str]:
    """The bundled recipes that compress a causal LM, in name order."""
    return [name for name, why_not in llm_recipes().items() if why_not is None]


def is_moe_recipe(name: str) -> bool:
    """Whether the bundled recipe ``name`` has a mixture-of-experts stage (:data:`MOE_STAGES`)."""
    from slimkit.recipes.loading import load_recipe

    _, raw = load_recipe(name)
    return any(stage.get("stage") in MOE_STAGES for stage in flat_stages(raw))
