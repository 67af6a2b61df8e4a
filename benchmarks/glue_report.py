"""The GLUE grid's claims, decided over the seeds' pairings, and its Markdown tables.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from typing import Any

from benchmarks.claims import NOT_RUN, compare, describe
from benchmarks.core.tables import cell
from benchmarks.glue_rows import GlueGrid
from benchmarks.grid import pct


def finished(rows: list[dict[str, Any]], task: str, name: str, ratio: float | None) -> list[dict[str, Any]]:
    """The finished seeds of one row at one ratio (``ratio`` None: the task models)."""
    return [
        r
        for r in rows
        if r.get("status") == "ok"
        and r.get("value") is not None
        and r.get("task") == task
        and r.get("name") == name
        and (ratio is None or abs(r.get("ratio", -1.0) - ratio) < 1e-9)
    ]


def draws(rows: list[dict[str, Any]], task: str, name: str, ratio: float | None) -> list[float]:
    """The finished seeds' dev metric of one row at one ratio (``ratio`` None: the task models)."""
    return [r["value"] for r in finished(rows, task, name, ratio)]


def seed_gains(rows: list[dict[str, Any]], task: str, better: str, worse: str, ratio: float) -> list[float]:
    """``better - worse`` for every seed where both finished (both start from that seed's task model)."""
    a, b = ({r["seed"]: r["value"] for r in finished(rows, task, name, ratio)} for name in (better, worse))
    return [a[seed] - b[seed] for seed in sorted(a.keys() & b.keys())]


def decide_claims(
    rows: list[dict[str, Any]], grid: GlueGrid, tasks: list[str], seeds: int | None = None
) -> list[dict[str, Any]]:
    """Every claim per task and ratio over the seeds' pairings, plus SP3's "most on small data": SP3's gain over CoFi
    per seed (both from that seed's task model) on RTE against SST-2, every pairing of gains over both ratios.

    A verdict from fewer draws than ``seeds`` (default: the grid's seeds) on either side is marked ``provisional``
    (``"1 of 3 seeds"``): one pairing of single draws is not a decision."""
    wanted = seeds or len(grid.settings.seeds)
    ratios_of = {row.name: row.ratios or grid.settings.ratios for row in grid.rows}
    decided: list[dict[str, Any]] = []
    gains: dict[str, list[float]] = {}
    partial: set[str] = set()
    for claim in grid.claims:
        for task in tasks:
            for ratio in claim.ratios or ratios_of[claim.better]:
                a, b = draws(rows, task, claim.better, ratio), draws(rows, task, claim.worse, ratio)
                label_a, label_b = f"{claim.better}@{pct(ratio)}", f"{claim.worse}@{pct(ratio)}"
                entry = {
                    "id": f"{claim.id}:{task}@{pct(ratio)}",
                    "claim": claim.claim,
                    "source": claim.source,
                    "task": task,
                    "ratio": ratio,
                }
                if not a or not b:
                    decided.append(
                        {
                            **entry,
                            "verdict": NOT_RUN,
                            "evidence": f"{label_a}: {len(a)} seeds, {label_b}: {len(b)} seeds",
                        }
                    )
                    continue
                verdict, held = compare(">", a, 1.0, b)
                gap = sum(a) / len(a) - sum(b) / len(b)
                if claim.id == "sp3-vs-cofi":
                    gains.setdefault(task, []).extend(seed_gains(rows, task, claim.better, claim.worse, ratio))
                evidence = f"{describe(label_a, a)} > {describe(label_b, b)}: {held} of {len(a) * len(b)} pairings"
                entry |= {"verdict": verdict, "gap": gap, "evidence": evidence}
                if min(len(a), len(b)) < wanted:
                    entry["provisional"] = f"{min(len(a), len(b))} of {wanted} seeds"
                    if claim.id == "sp3-vs-cofi":
                        partial.add(task)
                decided.append(entry)
    if any(c.id == "sp3-vs-cofi" for c in grid.claims):
        if gains.get("rte") and gains.get("sst2"):
            rte, sst2 = gains["rte"], gains["sst2"]
            verdict, held = compare(">", rte, 1.0, sst2)
            evidence = (
                f"per-seed gain rte {sum(rte) / len(rte):+.4f} ({len(rte)} seed x ratio) vs sst2 "
                f"{sum(sst2) / len(sst2):+.4f} ({len(sst2)}): {held} of {len(rte) * len(sst2)} pairings"
            )
        else:
            verdict, evidence = NOT_RUN, "needs rte and sst2 rows"
        small_data = {
            "id": "sp3-gain-small-data",
            "claim": "the PCA projection helps most on small datasets (RTE more than SST-2)",
            "source": "SP3, Tables 2/3",
            "verdict": verdict,
            "evidence": evidence,
        }
        if verdict != NOT_RUN and partial & {"rte", "sst2"}:
            small_data["provisional"] = f"fewer than {wanted} seeds on {', '.join(sorted(partial & {'rte', 'sst2'}))}"
        decided.append(small_data)
    return decided


def _device(row: dict[str, Any], result: dict[str, Any]) -> str:
    """Where ``row`` ran (a row of an older results file: the file's device)."""
    return row.get("device") or result.get("device") or "cpu"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f} (1 seed)"
    return f"{_mean(values):.4f} [{min(values):.4f}-{max(values):.4f}]"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"# GLUE grid: {result['name']} ({result['date']})",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine'].get('cpu', '?')}, {result['machine'].get('cores', '?')} cores"
        f"{', ' + result['device'] if result.get('device') else ''}; wall {result.get('wall_s', 0):.0f} s."
        + (
            f" Finished rows reused from `{result['reused_from']}` (the device of each run is in the last table)."
            if result.get("reused_from")
            else ""
        ),
        "",
        "Dev metric (accuracy; STS-B: Spearman) as mean [min-max] over the seeds that finished (with the seeds per "
        "device where they ran on more than one; seconds are then means over devices). Sparsity: Eq. 30 of the binary "
        "masks. Settle gap: mean |expected sparsity - target| over the last fifth of the mask steps.",
        "",
        "| task | row | seeds | dev metric | Eq. 30 sparsity | settle gap | mask steps | s/step | wall s |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups: dict[tuple[str, str, float | None], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row.get("name", "?"), row.get("ratio")), []).append(row)
    for (task, name, ratio), members in groups.items():
        ok = [m for m in members if m.get("status") == "ok" and m.get("value") is not None]
        label = name if ratio is None else f"{name}@{pct(ratio)}"

        def avg(key: str, members: list[dict[str, Any]] = ok) -> float | None:
            return _mean([m[key] for m in members if m.get(key) is not None])

        devices = [_device(m, result) for m in ok]
        mixed = (
            f" ({', '.join(f'{d} {devices.count(d)}' for d in sorted(set(devices)))})" if len(set(devices)) > 1 else ""
        )
        lines.append(
            f"| {task} | {label} | {len(ok)}/{len(members)}{mixed} | {_spread([m['value'] for m in ok])} | "
            f"{cell(avg('binary_sparsity'), '.2%')} | {cell(avg('settle_gap'), '.3f')} | "
            f"{cell(avg('mask_steps'), '.0f')} | {cell(avg('seconds_per_step'), '.3f')} | "
            f"{cell(avg('wall_s'), '.0f')} |"
        )
    lines += ["", "## Claims", "", "| claim | source | task | verdict | evidence |", "| --- | --- | --- | --- | --- |"]
    for claim in result["claims"]:
        task = claim.get("task", "-")
        where = task if claim.get("ratio") is None else f"{task} @ {pct(claim['ratio'])}%"
        provisional = f" (provisional: {claim['provisional']})" if "provisional" in claim else ""
        verdict = f"**{claim['verdict']}**{provisional}"
        lines.append(f"| {claim['claim']} | {claim['source']} | {where} | {verdict} | {claim.get('evidence', '')} |")
    lines += [
        "",
        "## Every run",
        "",
        "| run | device | dev metric | Eq. 30 sparsity | expected sparsity at every tenth of the mask steps | "
        "masked = fused | status |",
        "| --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        trace = " ".join(f"{v:.2f}" for v in row.get("trace") or []) or "-"
        agreement = (row.get("masked_vs_fused") or {}).get("prediction_agreement")
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason', '')}"
        lines.append(
            f"| {row['id']} | {_device(row, result)} | {cell(row.get('value'), '.4f')} | "
            f"{cell(row.get('binary_sparsity'), '.2%')} | {trace} | "
            f"{cell(agreement, '.3f')} | {status} |"
        )
    return "\n".join(lines) + "\n"
