"""The ``search`` stage's budgets as linear constraints of the selection: the recipe's target (parameters of its part
removed, within its tolerance), the rule that one attention and one MLP block stay, the optional memory and latency
budgets and the equalities of ``uniform``; the latency table measured once per model shape, runtime and machine (or
given).

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import math
from pathlib import Path

from slimkit.engine.context import Context
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import staging_file
from slimkit.primitives.search.build import BuildSettings
from slimkit.primitives.search.costs import MemoryAt, model_memory
from slimkit.primitives.search.latency import (
    LatencySettings,
    LatencyTable,
    LlamacppTiming,
    PytorchTiming,
    Timing,
    measure_table,
    table_key,
)
from slimkit.primitives.search.selection import Budget, NoFeasibleChoice, Selection, same_choice, select
from slimkit.stages.search_args import LatencyBudget, SearchArgs
from slimkit.stages.search_library import Scored

Slots = list[list[Scored]]


def target_budgets(ctx: Context, slots: Slots) -> tuple[Budget, Budget]:
    """Parameters of the target's part removed: at least what is left of the target (up to its tolerance above it),
    and, where no choice does that, anywhere within its tolerance."""
    target = ctx.recipe.target
    dense = ctx.params_before[target.part]
    wanted = ctx.params_to_remove()
    slack = math.floor(target.tolerance * dense)
    costs = [[float(entry.removed.get(target.part, 0)) for entry in slot] for slot in slots]
    name = f"parameters removed ({target.part})"
    return Budget(name, costs, upper=wanted + slack, lower=wanted), Budget(
        name, costs, upper=wanted + slack, lower=max(0, wanted - slack)
    )


def choose(
    scores: list[list[float]],
    target: tuple[Budget, Budget],
    others: list[Budget],
    time_limit: float | None,
    strict: bool,
) -> tuple[Selection, list[Budget], list[str]]:
    """The selection under the first of the target's windows a choice meets (with the other budgets); else, for a
    target that is not strict, under the nearest removal a choice reaches (with a note). Refused in one line when
    the other budgets alone exclude every choice, or the target is strict."""
    for budget in target:
        try:
            return select(scores, [budget, *others], time_limit), [budget, *others], []
        except NoFeasibleChoice:
            continue
    select([[0.0] * len(slot) for slot in scores], others, time_limit)  # raises when the others alone do
    widened, note = nearest_target(target[1], others, time_limit, strict)
    return select(scores, [widened, *others], time_limit), [widened, *others], [note]


def kept_blocks_budgets(slots: Slots) -> list[Budget]:
    """At most all but one attention (MLP) sub-block removed: a decoder keeps at least one of each."""
    budgets = []
    for part in ("attention", "mlp"):
        present = sum(1 for slot in slots if slot[0].spec.part == part)
        costs = [[1.0 if e.spec.part == part and e.spec.kind == "removed" else 0.0 for e in slot] for slot in slots]
        if present:
            budgets.append(Budget(f"{part} blocks removed", costs, upper=present - 1))
    return budgets


def uniform_budgets(args: SearchArgs, slots: Slots) -> list[Budget]:
    """The equalities that give every layer of one shape the same replacement of each sub-block in ``uniform``."""
    names = [[entry.spec.name for entry in slot] for slot in slots]
    return same_choice(names, [slot[0].spec.part in args.uniform for slot in slots])


def memory_budget(ctx: Context, args: SearchArgs, slots: Slots) -> tuple[Budget, int] | None:
    """Bytes removed at the memory budget's context and batch, at least what brings the model under its limit; and
    the dense model's memory there."""
    if args.memory_budget is None:
        return None
    at = MemoryAt(args.memory_budget.context, args.memory_budget.batch, args.memory_budget.kv_bytes)
    dense = model_memory(ctx.model, at)
    costs = [[float(entry.memory(at)) for entry in slot] for slot in slots]
    return Budget("memory removed (bytes)", costs, lower=dense - args.memory_budget.limit_bytes()), dense


def latency_budgets(args: SearchArgs, slots: Slots, table: LatencyTable) -> list[Budget]:
    """Per phase, the seconds the chosen candidates add, at most what leaves the dense time divided by the
    speed-up."""
    latency = args.latency_budget
    if latency is None:
        return []
    budgets = []
    for phase in latency.phases:
        dense = table.dense[phase]
        costs = [[table.cost(entry.spec, phase) for entry in slot] for slot in slots]
        budgets.append(Budget(f"{table.runtime} {phase} seconds added", costs, upper=dense / latency.speedup - dense))
    return budgets


def latency_settings(latency: LatencyBudget) -> LatencySettings:
    return LatencySettings(latency.runtime, latency.context, latency.new_tokens, 1, latency.repeats, latency.threads)


def read_table(path: str) -> LatencyTable:
    """A latency table from a JSON file (one line when it cannot be read or is not one)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise SlimkitError(f"search: latency_budget.table {path}: cannot read it ({error.strerror or error})") from None
    return LatencyTable.from_json(text, f"search: latency_budget.table {path}")


def latency_table(ctx: Context, args: SearchArgs, slots: Slots, root: Path | None) -> LatencyTable | None:
    """The table the latency budget reads: the given file, the stored one for this model, runtime and machine, or
    one measured now (and stored)."""
    latency = args.latency_budget
    if latency is None:
        return None
    if latency.table is not None:
        table = read_table(latency.table)
        if table.runtime != latency.runtime:
            raise SlimkitError(
                f"search: latency_budget.table {latency.table} was measured in {table.runtime}, "
                f"the budget asks {latency.runtime}"
            )
        return table
    specs = [entry.spec for slot in slots for entry in slot]
    settings = latency_settings(latency)
    path = None if root is None else root / "latency" / f"{table_key(ctx.model, specs, settings)}.json"
    if path is not None and path.is_file() and not path.is_symlink():
        try:
            return LatencyTable.from_json(path.read_text(), str(path))
        except SlimkitError as error:
            ctx.notes.append(f"search: the stored latency table was ignored and measured again: {error}")
    timing: Timing = (
        PytorchTiming(int(ctx.model.config.vocab_size), settings)
        if latency.runtime == "pytorch"
        else LlamacppTiming(ctx.tokenizer, settings)
    )
    with ctx.tracker.task("search: latency table", None):
        table = measure_table(ctx.model, specs, settings, timing, BuildSettings())
    if path is not None:
        partial = staging_file(path)
        partial.write_text(table.to_json())
        partial.replace(path)
    return table


def nearest_removals(
    target: Budget, others: list[Budget], time_limit: float | None
) -> tuple[float | None, float | None]:
    """The most parameters a choice can remove up to the target's upper bound, and the fewest from its lower bound,
    within the other budgets (None where no choice does)."""
    found: list[float | None] = []
    for sign, bound in (
        (-1.0, Budget(target.name, target.costs, upper=target.upper)),
        (1.0, Budget(target.name, target.costs, lower=target.lower)),
    ):
        try:
            found.append(
                sign
                * select([[sign * c for c in slot] for slot in target.costs], [bound, *others], time_limit).objective
            )
        except NoFeasibleChoice:
            found.append(None)
    return found[0], found[1]


def nearest_target(target: Budget, others: list[Budget], time_limit: float | None, strict: bool) -> tuple[Budget, str]:
    """The target widened to the nearest removal a choice reaches within the other budgets, and a note; a strict
    target is refused in one line naming the nearest removals instead."""
    below, above = nearest_removals(target, others, time_limit)
    reach = ", ".join(f"{v:,.0f}" for v in (below, above) if v is not None) or "none"
    message = (
        f"no choice of candidates removes {target.lower:,.0f}-{target.upper:,.0f} parameters within the other "
        f"budgets; the nearest: {reach}"
    )
    if strict or (below is None and above is None):
        raise SlimkitError(f"search: {message} (loosen target.tolerance, or set target.strict: false)")
    if above is None or (below is not None and target.lower - below <= above - target.upper):
        widened = Budget(target.name, target.costs, upper=target.upper, lower=float(below or 0.0))
    else:
        widened = Budget(target.name, target.costs, upper=float(above), lower=target.lower)
    return widened, f"search: {message}; the target is not strict, so the search lands there"


__all__ = [
    "kept_blocks_budgets",
    "latency_budgets",
    "latency_table",
    "memory_budget",
    "nearest_target",
    "read_table",
    "target_budgets",
    "uniform_budgets",
]
