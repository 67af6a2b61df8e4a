"""``slimkit compress``'s recipes: the bundled ``search`` recipe set to a model and its budgets, and the bundled recipes
it is compared with at the same parameter budget; and the comparison table from the runs' reports.

A budget in parameters (``params``: the fraction kept) is the recipe's target; without one the target is
``{ratio: 0, tolerance: 1}`` (any parameter count) and the memory or speed-up budget binds. Checked before any compute:
at least one budget, a size the memory budget can read, recipes to compare that are bundled.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slimkit.primitives.errors import unknown
from slimkit.primitives.search.candidates import Part
from slimkit.primitives.settings import Strict
from slimkit.recipes.loading import bundled_recipes, parse_yaml, read_recipe_text, recipe_path
from slimkit.recipes.schema import SizeText

SEARCH_RECIPE = "search"


class CompressSettings(Strict):
    """The front door's budgets, one field each (the command line's options)."""

    params: float | None = Field(None, gt=0.0, lt=1.0)
    """Fraction of the model's parameters kept (0.8: remove 20%)."""
    memory: SizeText | None = None
    """The most memory the model may take at ``context`` and ``batch``: its weights plus its KV cache (e.g. 2GiB)."""
    context: int = Field(4096, ge=1)
    """Tokens per sequence the memory budget's KV cache holds."""
    batch: int = Field(1, ge=1)
    """Sequences at once for the memory budget."""
    speedup: float | None = Field(None, gt=1.0, le=100.0)
    """How many times faster than dense the model must be in ``runtime`` (prefill and decode), against measured
    per-candidate times."""
    runtime: Literal["llama.cpp", "pytorch"] = "llama.cpp"
    """Where the model will be served (what the speed-up is measured in)."""
    uniform: list[Part] = Field(default_factory=list)
    """Sub-blocks replaced alike in every layer of one shape (the search's ``uniform``: for runtimes that read one
    width for every layer)."""
    time_limit: float | None = Field(None, gt=0.0)
    """Seconds for the search (candidates not scored by then are left out)."""
    compare: list[str] = Field(default_factory=list)
    """Bundled recipes to run at the same parameter budget beside the search (e.g. quality, deploy)."""

    @field_validator("compare")
    @classmethod
    def _bundled(cls, value: list[str]) -> list[str]:
        names = sorted(bundled_recipes())
        for name in value:
            if name not in names or name == SEARCH_RECIPE:
                raise ValueError(unknown("bundled recipe", name, [n for n in names if n != SEARCH_RECIPE]))
        if len(set(value)) != len(value):
            raise ValueError("each recipe once")
        return value

    @model_validator(mode="after")
    def _a_budget(self) -> CompressSettings:
        if self.params is None and self.memory is None and self.speedup is None:
            raise ValueError("give a budget: params (fraction kept), memory (e.g. 2GiB) or speedup (with runtime)")
        return self


def _bundled(name: str) -> dict[str, Any]:
    path = recipe_path(name)
    return parse_yaml(read_recipe_text(path), str(path))


def compress_recipe(model: str | dict[str, Any], settings: CompressSettings) -> dict[str, Any]:
    """The bundled search recipe for ``model`` (a source, or a ``model:`` mapping) under ``settings``' budgets."""
    raw = _bundled(SEARCH_RECIPE)
    raw["name"] = "compress"
    raw["model"] = model
    if settings.params is not None:
        raw["target"] = {"ratio": round(1.0 - settings.params, 12), "of": "model"}
    else:
        raw["target"] = {"ratio": 0.0, "of": "model", "tolerance": 1.0}
    args: dict[str, Any] = {}
    if settings.memory is not None:
        args["memory_budget"] = {"limit": settings.memory, "context": settings.context, "batch": settings.batch}
    if settings.speedup is not None:
        args["latency_budget"] = {"speedup": settings.speedup, "runtime": settings.runtime}
    if settings.uniform:
        args["uniform"] = list(settings.uniform)
    if settings.time_limit is not None:
        args["time_limit"] = settings.time_limit
    raw["stages"] = [{"stage": "search", "args": args}]
    return raw


def compare_recipe(name: str, searched: dict[str, Any], ratio: float) -> dict[str, Any]:
    """Bundled recipe ``name`` on the searched recipe's model, seed and evaluation, at ``ratio`` of the model."""
    raw = _bundled(name)
    raw["model"] = searched["model"]
    raw["seed"] = searched.get("seed", raw.get("seed", 0))
    raw["target"] = {**raw["target"], "ratio": ratio, "of": "model"}
    raw["eval"] = searched.get("eval", raw.get("eval"))
    return raw


def comparison_rows(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run (``report.json`` mappings by name): parameters, ratio, target met, each perplexity."""
    rows = []
    for name, report in reports.items():
        metrics = report.get("metrics") or {}
        row: dict[str, Any] = {
            "recipe": name,
            "params": (report.get("params") or {}).get("after"),
            "ratio": (report.get("target") or {}).get("achieved"),
        }
        row |= {key: value for key, value in metrics.items() if key.endswith("_ppl")}
        rows.append(row)
    return rows


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    metrics = sorted({key for row in rows for key in row if key.endswith("_ppl")})
    lines = ["| recipe | parameters | removed | " + " | ".join(metrics) + " |"]
    lines.append("| --- | ---: | ---: | " + " | ".join("---:" for _ in metrics) + " |")
    for row in rows:
        ratio = row.get("ratio")
        cells = [
            row["recipe"],
            f"{row['params']:,}" if row.get("params") is not None else "-",
            f"{ratio:.1%}" if ratio is not None else "-",
        ]
        cells += [f"{row[m]:.2f}" if row.get(m) is not None else "-" for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class Compressed:
    """What ``slimkit.compress`` returns: the search run's result, each compared recipe's result (in memory), the
    comparison's rows."""

    search: Any
    compared: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


def run_comparison(
    searched: dict[str, Any], report: dict[str, Any], names: list[str], run: Callable[..., Any], evaluate: bool = True
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each bundled recipe of ``names`` run (by ``run``, in memory) at the searched model's achieved ratio; their
    results, and the rows of the search and each of them."""
    ratio = float(report["target"]["achieved"])
    compared = {
        name: run(compare_recipe(name, searched, ratio), None, evaluate=evaluate, compare_dense=False) for name in names
    }
    reports = {"search": report, **{name: result.report.as_json() for name, result in compared.items()}}
    return compared, comparison_rows(reports)


def write_comparison(out: Path, rows: list[dict[str, Any]]) -> None:
    """``out/compare.md`` and ``out/compare.json``."""
    (out / "compare.md").write_text(comparison_markdown(rows))
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")


__all__ = [
    "CompressSettings",
    "Compressed",
    "compare_recipe",
    "comparison_markdown",
    "comparison_rows",
    "compress_recipe",
    "run_comparison",
    "write_comparison",
]
