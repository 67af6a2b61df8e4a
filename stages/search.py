"""``search`` (model scope): the best model under a budget, found rather than hand-picked (Puzzle, Bercovich et al.
2024; Model-Optimizer's Puzzletron).

For every layer, a library of replacements of its attention and its MLP made by slimkit's own primitives (heads or KV
groups kept, AWSVD low-rank attention, MLP channels kept, routed experts kept, the sub-block removed), each refit the
way its stage refits and scored by the KL divergence of the next-token distribution when it alone replaces its
parent on held-out calibration tokens; then one candidate per sub-block chosen exactly by a mixed-integer program
(HiGHS) minimising the summed scores within the recipe's target (its ``of`` part's parameters, within its tolerance)
and, optionally, a memory budget at a context and batch and a speed-up against a measured latency table. The run
writes ``OUT/search/``: ``recipe.yaml`` (the recipe with the choice fixed: it reproduces the model bit for bit with no
search), ``scores.json`` (every candidate's score and costs), ``scores.png`` (the scores per layer), ``layers.md``
and the latency table it used. With ``chosen`` the stage only puts the named candidates in place.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.primitives.allocate.fitness import mean_kl
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.latency import LatencyTable
from slimkit.primitives.search.picture import layer_table, plot_scores
from slimkit.primitives.search.selection import Budget, Selection
from slimkit.primitives.search.store import LibraryStore, default_root
from slimkit.stages.search_args import SearchArgs, chosen_specs, search_settings
from slimkit.stages.search_budgets import (
    choose,
    kept_blocks_budgets,
    latency_budgets,
    latency_table,
    memory_budget,
    target_budgets,
    uniform_budgets,
)
from slimkit.stages.search_library import (
    LibraryCost,
    Scored,
    apply_choice,
    apply_sequential,
    library_pass,
    split_batches,
)

MIN_SOLVER_SECONDS = 10.0


def _budget_report(budget: Budget, total: float) -> dict[str, float | None]:
    bound = {"lower": budget.lower, "upper": budget.upper}
    return {"total": total, **{k: (v if abs(v) != float("inf") else None) for k, v in bound.items()}}


def written_recipe(ctx: Context, args: SearchArgs, chosen: dict[int, dict[str, str]]) -> dict[str, Any]:
    """The run's recipe with this stage's choice fixed (its budgets dropped: a fixed choice reads none)."""
    raw = ctx.recipe.source()
    raw["stages"][ctx.block.index] = {"stage": "search", "args": {**search_settings(args), "chosen": chosen}}
    return raw


def _scores(slots: list[list[Scored]]) -> dict[str, dict[int, dict[str, float]]]:
    found: dict[str, dict[int, dict[str, float]]] = {}
    for slot in slots:
        for entry in slot:
            found.setdefault(entry.spec.part, {}).setdefault(entry.layer, {})[entry.spec.name] = entry.kl
    return found


def _artifacts(
    recipe: dict[str, Any],
    slots: list[list[Scored]],
    chosen: dict[int, dict[str, str]],
    table: LatencyTable | None,
) -> Callable[[Path], object]:
    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        entries = [
            {
                "layer": e.layer,
                "part": e.spec.part,
                "candidate": e.spec.name,
                "kl": e.kl,
                "removed": e.removed,
                "removed_bytes": e.removed_bytes,
                "kv_heads": e.kv_heads,
            }
            for slot in slots
            for e in slot
        ]
        (folder / "scores.json").write_text(json.dumps(entries, indent=1) + "\n")
        by_part = {
            part: {layer: names[part] for layer, names in chosen.items() if part in names}
            for part in ("attention", "mlp")
        }
        plot_scores(_scores(slots), by_part, folder / "scores.png")
        (folder / "layers.md").write_text("\n".join(layer_table(_scores(slots), by_part)) + "\n")
        if table is not None:
            (folder / "latency.json").write_text(table.to_json())

    return write


def _selection_entry(
    selection: Selection, budgets: list[Budget], slots: list[list[Scored]], cost: LibraryCost
) -> dict[str, Any]:
    layers: dict[str, dict[str, Any]] = {}
    for slot, index in zip(slots, selection.choice, strict=True):
        entry = slot[index]
        row = layers.setdefault(str(entry.layer), {})
        row[entry.spec.part] = entry.spec.name
        row[f"{entry.spec.part}_kl"] = round(entry.kl, 6)
    return {
        "mode": "searched",
        "candidates": sum(len(slot) - 1 for slot in slots),
        "slots": len(slots),
        "budgets": {b.name: _budget_report(b, selection.totals[b.name]) for b in budgets},
        "solver": {"optimal": selection.optimal, "seconds": round(selection.seconds, 3), "gap": selection.gap},
        "kl_sum": selection.objective,
        "layers": layers,
        "cost": {
            "built": cost.built,
            "read": cost.read,
            "scores_measured": cost.scores_measured,
            "scores_read": cost.scores_read,
            "layers": {str(k): v for k, v in cost.layers.items()},
        },
    }


@register_stage(
    "search",
    args=SearchArgs,
    paper="Puzzle (Bercovich et al. 2024; Model-Optimizer's Puzzletron): a block library per layer, each variant "
    "scored by the KL when it alone replaces its parent, one variant per layer chosen by a mixed-integer program",
)
class Search:
    """Choose one replacement per attention and MLP sub-block (from a library of slimkit's own) under the budgets."""

    def run_model(self, ctx: Context, args: SearchArgs) -> StageResult:
        args.check_model(ctx.model)
        store = LibraryStore(default_root() if args.store else None)
        try:
            if args.chosen is not None:
                done = _apply(ctx, args, chosen_specs(args.chosen), store)
                chosen = {str(k): v for k, v in args.chosen.items()}
                return StageResult({"mode": "fixed", "chosen": chosen, "candidates": done})
            return self._search(ctx, args, store)
        finally:
            ctx.notes.extend(store.notes)

    def _search(self, ctx: Context, args: SearchArgs, store: LibraryStore) -> StageResult:
        start = time.perf_counter()
        deadline = start + args.time_limit if args.time_limit is not None else None
        slots, cost, dense = library_pass(ctx, args, store, deadline)
        library_seconds = time.perf_counter() - start
        tick = time.perf_counter()
        table = latency_table(ctx, args, slots, store.root)
        latency_seconds = time.perf_counter() - tick
        others = kept_blocks_budgets(slots)
        memory = memory_budget(ctx, args, slots)
        if memory is not None:
            others.append(memory[0])
        if table is not None:
            others += latency_budgets(args, slots, table)
        ties = uniform_budgets(args, slots)
        left = None if deadline is None else max(MIN_SOLVER_SECONDS, deadline - time.perf_counter())
        scores = [[entry.kl for entry in slot] for slot in slots]
        target = target_budgets(ctx, slots)
        selection, budgets, notes = choose(scores, target, [*others, *ties], left, ctx.recipe.target.strict)
        budgets = budgets[: len(budgets) - len(ties)]  # the equalities are reported as the uniform choice
        ctx.notes.extend(notes)
        choice: dict[tuple[int, str], CandidateSpec] = {
            (slot[i].layer, slot[i].spec.part): slot[i].spec for slot, i in zip(slots, selection.choice, strict=True)
        }
        applied = _apply(ctx, args, choice, store)
        _fit, held = split_batches(ctx, args)
        measured = mean_kl(ctx.model, held, dense)
        chosen: dict[int, dict[str, str]] = {}
        for (layer, part), spec in sorted(choice.items()):
            chosen.setdefault(layer, {})[part] = spec.name
        details = _selection_entry(selection, budgets, slots, cost)
        details["kl_measured"] = measured
        if args.uniform:
            details["uniform"] = {"parts": list(args.uniform), "equalities": len(ties)}
        details["applied"] = applied
        details["seconds"] = round(time.perf_counter() - start, 2)
        details["library_seconds"] = round(library_seconds, 2)
        details["latency_table_seconds"] = round(latency_seconds, 2)
        if memory is not None:
            details["memory"] = {
                "dense_bytes": memory[1],
                "limit": args.memory_budget.limit if args.memory_budget else None,
            }
        if table is not None:
            details["latency"] = _latency_entry(table, selection, budgets)
        if cost.skipped:
            details["skipped"] = cost.skipped
            ctx.notes.append(
                f"search: the time limit left {len(cost.skipped)} candidates unscored (left out of the choice)"
            )
        ctx.notes.extend(f"search: {note}" for note in selection.notes)
        recipe = written_recipe(ctx, args, chosen)
        return StageResult(details, artifacts={"search": _artifacts(recipe, slots, chosen, table)})


def _apply(
    ctx: Context, args: SearchArgs, choice: dict[tuple[int, str], CandidateSpec], store: LibraryStore
) -> dict[str, int]:
    if args.refit_chosen == "sequential":
        return apply_sequential(ctx, args, choice, store)
    return apply_choice(ctx, args, choice, store)


def _latency_entry(table: LatencyTable, selection: Selection, budgets: list[Budget]) -> dict[str, Any]:
    estimated = {}
    for budget in budgets:
        for phase, dense in table.dense.items():
            if budget.name == f"{table.runtime} {phase} seconds added":
                total = dense + selection.totals[budget.name]
                estimated[phase] = {
                    "dense_s": dense,
                    "estimated_s": total,
                    "speedup": dense / total if total > 0 else None,
                }
    return {"runtime": table.runtime, "phases": estimated, "notes": table.notes}


__all__ = ["Search", "written_recipe"]
