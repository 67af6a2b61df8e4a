"""The results of ``python -m benchmarks.scale``: growth exponents fitted to the rows, and the Markdown tables.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.core.outputs import write_results
from benchmarks.core.recipes import RECOVERY_STAGES

STATEMENT = (
    "Random weights: these rows measure compression cost (time, memory) only, not quality; "
    "perplexity of a random-weight model is meaningless and is not measured."
)


def fit_power(xs: Sequence[float], ys: Sequence[float | None]) -> dict[str, Any] | None:
    """Least squares on logs, ``y = c * x^exponent``; None with fewer than two distinct positive points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y is not None and y > 0]
    if len(points) < 2 or len({p[0] for p in points}) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((p[1] - my) ** 2 for p in points)
    ss_res = sum((p[1] - intercept - slope * p[0]) ** 2 for p in points)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"exponent": slope, "coefficient": math.exp(intercept), "r2": r2, "points": n}


FITS = (
    # (sweep kind, x: row key or callable name, label)
    ("depth", "layers", "layers"),
    ("width", "hidden", "hidden"),
    ("real", "layer_params", "layer params"),
)
COSTS = (("compress_s", "compression s"), ("peak_rss_above_baseline_mb", "peak RSS above baseline"))


def _sweeps(row: dict[str, Any]) -> list[str]:
    """The fits a row takes part in: its sweeps (a shape can be in both the depth and the width sweep)."""
    return row.get("sweeps") or [row["kind"]]


def exponents(rows: list[dict[str, Any]], recipes: list[str]) -> list[dict[str, Any]]:
    found = []
    for recipe in recipes:
        for kind, key, label in FITS:
            chosen = [r for r in rows if r["recipe"] == recipe and kind in _sweeps(r) and r["status"] == "ok"]
            for cost, cost_label in COSTS:
                fit = fit_power([r[key] for r in chosen], [r.get(cost) for r in chosen])
                found.append(
                    {
                        "recipe": recipe,
                        "sweep": kind,
                        "x": label,
                        "cost": cost_label,
                        "cost_key": cost,
                        **(fit or {"exponent": None, "r2": None, "points": len(chosen)}),
                    }
                )
    return found


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _gb(mb: float | None) -> str:
    return "-" if mb is None else f"{mb / 1024:.2f}"


def _concurrent(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows come from a ``--jobs`` run (each says which rows ran beside it)."""
    return any("beside" in r for r in rows)


def run_cell(row: dict[str, Any]) -> str:
    """How a row ran: alone, beside N other rows (its times are not comparable with a row run alone), or alone
    again after it ran short of memory beside others."""
    first = row.get("rerun_of")
    if first is not None:
        return f"alone (again, after {first.get('status')} beside {len(first.get('beside') or [])})"
    beside = row.get("beside") or []
    return f"beside {len(beside)}" if beside else "alone"


def _rows_table(rows: list[dict[str, Any]], gpu: bool) -> list[str]:
    concurrent = _concurrent(rows)
    head = "| shape | recipe" + (" | run" if concurrent else "") + " | layers | hidden | params | weights GiB "
    head += "| load s | calib s | stage s | save s "
    head += "| compress s | s/layer | peak RSS GiB | above baseline GiB" + (" | peak GPU GiB" if gpu else "")
    extra = any(r.get("load_average_1m") is not None for r in rows)
    head += " | achieved | per stage s |" + (" process CPU s | load 1m |" if extra else "")
    lines = [head, "|" + " --- |" * (2 + concurrent) + " ---: |" * (head.count("|") - 3 - concurrent)]
    for r in rows:
        run = [run_cell(r)] if concurrent else []
        if r["status"] != "ok":
            cells = [r["shape"], f"`{r['recipe']}`", *run, str(r["layers"]), str(r["hidden"]), "-"]
            cells.append(_gb(r["weights_mb"]))
            lines.append("| " + " | ".join(cells) + f" | **{r['status']}**: {r.get('reason', '')} |")
            continue
        stage = sum(v for k, v in r["stages_s"].items() if k[:1].isdigit())
        cells = [
            r["shape"],
            f"`{r['recipe']}`",
            *run,
            str(r["layers"]),
            str(r["hidden"]),
            f"{r['params_before'] / 1e6:,.0f}M",
            _gb(r["weights_mb"]),
            _num(r["load_s"]),
            _num(r["calibration_s"]),
            _num(stage),
            _num(r["save_s"]),
            _num(r["compress_s"]),
            _num(r["s_per_layer"]),
            _gb(r["peak_rss_mb"]),
            _gb(r.get("peak_rss_above_baseline_mb")),
            *([_gb(r["peak_gpu_mb"])] if gpu else []),
            "-" if r["achieved"] is None else f"{r['achieved']:.2%}" + ("" if r["target_met"] else " (missed)"),
            ", ".join(f"{k} {_num(v)}" for k, v in r["stages_s"].items() if k[:1].isdigit()) or "-",
            *([_num(r.get("process_cpu_s")), _num(r.get("load_average_1m"), 2)] if extra else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _concurrency_lines(concurrency: dict[str, Any] | None) -> list[str]:
    if not concurrency:
        return []
    known = ", ".join(f"`{Path(p).name}`" for p in concurrency.get("known_peaks") or [])
    rule = f"max(memory plan, peak measured in {known})" if known else "memory plan"
    return [
        f"- `--jobs {concurrency['jobs']}`: rows ran as concurrent processes, a row starting when the running rows' "
        f"expected peaks plus its own fit in {concurrency['capacity_gib']:.1f} GiB ({concurrency['memory_fraction']:g} "
        f"of {concurrency['device_gib']:.1f}) and their saved models on the scratch disk; expected peak = {rule} x "
        f"{concurrency['plan_margin']:g} + {concurrency['process_gib']:g} GiB. Column 'run': **times of a row run "
        "beside others are not comparable with a row run alone** (they shared the device and the cores); peak "
        "memory is each process's own; a row short of memory beside others ran again alone at the end"
    ]


def markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    rows = result["rows"]
    gpu = any(r.get("peak_gpu_mb") for r in rows)
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [
        f"# Compression cost vs model size ({result['date']})",
        "",
        f"**{STATEMENT}**",
        "",
        f"Command: `{result['command']}`",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.1f} GiB RAM, torch threads "
        f"{m['torch_threads']}; load average at start {m.get('load_average_start')}, at end "
        f"{m.get('load_average_end')} (other processes share the cores: compare rows of this file, prefer ratios)",
        f"- versions: {versions}; python {m['python']}",
        f"- device: {s['device']} ({result.get('device_name') or 'CPU'}), dtype {s['dtype']}",
        f"- runs: target 20% of the model's parameters (`target.strict: false`), calibration {s['samples']} x "
        f"{s['seq_len']} tokens of C4, each recipe's recovery stages ({', '.join(sorted(RECOVERY_STAGES))}) dropped, "
        "`--no-eval`; "
        "one process per row, so peak RSS is that run's own",
        "- compress s = calibration + the recipe's stages (load and save listed apart); s/layer = compress s / "
        "decoder layers; above baseline = peak RSS minus the baseline row (a 2-layer tiny model: the process "
        "itself)",
        *_concurrency_lines(s.get("concurrency")),
        f"- wall time of the whole benchmark: {result.get('wall_s', 0) + result.get('resumed_wall_s', 0):.0f} s "
        f"over {1 + bool(result.get('resumed_wall_s'))} invocation(s) (model building "
        f"{result.get('build_s', 0):.0f} s of it)",
        "",
    ]
    base = result.get("baseline") or {}
    if base:
        lines += [
            f"Baseline: {base.get('id')} peak RSS {_gb(base.get('peak_rss_mb'))} GiB "
            f"({'ok' if base.get('status') == 'ok' else base.get('reason')}).",
            "",
        ]
    for kind, title in (("real", "Real shapes"), ("depth", "Depth sweep"), ("width", "Width sweep")):
        order = {name: i for i, name in enumerate(result["settings"]["recipes"])}
        chosen = sorted(
            (r for r in rows if kind in _sweeps(r)),
            key=lambda r: (order.get(r["recipe"], len(order)), r.get("layer_params") or 0, r["layers"]),
        )
        if chosen:
            lines += [f"## {title}", "", *_rows_table(chosen, gpu), ""]
    fits = result.get("exponents") or []
    if fits:
        lines += [
            "## Growth exponents",
            "",
            "Least squares on logs, `cost = c * x^e`; depth: layers at SmolLM2-135M's width; width: hidden size "
            "at a fixed depth (MLP 8/3 x hidden); real: the real shapes against their decoder-layer parameters "
            "(embeddings excluded). R^2 of the fit in brackets; '-' where fewer than two rows ran.",
            "",
            "| recipe | cost | e(layers) | e(hidden) | e(layer params) |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for recipe in result["settings"]["recipes"]:
            for _cost, cost_label in COSTS:
                cells = []
                for kind, _key, _label in FITS:
                    fit = next(
                        (f for f in fits if f["recipe"] == recipe and f["sweep"] == kind and f["cost"] == cost_label),
                        None,
                    )
                    if fit is None or fit["exponent"] is None:
                        cells.append("-")
                    else:
                        cells.append(f"{fit['exponent']:.2f} ({fit['r2']:.2f}, n={fit['points']})")
                lines.append(f"| `{recipe}` | {cost_label} | " + " | ".join(cells) + " |")
        lines.append("")
    offload = [r for r in rows if r["kind"] == "offload"]
    if offload:
        lines += [
            "## Offload: weights larger than the memory budget",
            "",
            "`--max-memory` below the weights' size: accelerate keeps the embeddings, head and the layers that fit "
            "within the budget in memory and the rest on disk (CPU) or in CPU memory (CUDA); layer stages load one "
            "layer at a time. Peak RSS (`ru_maxrss`, the report's number) also counts file-backed pages: the "
            "memory-mapped offloaded weights each layer is read from, page cache the kernel can drop under "
            "pressure. The budget is about anonymous memory (sampled every 0.2 s from /proc): it holds when peak "
            "anonymous memory minus the baseline's stays near the budget plus one layer and its calibration "
            "activations, well below the weights.",
            "",
            "| shape | recipe"
            + (" | run" if _concurrent(offload) else "")
            + " | weights GiB | budget | baseline RSS GiB | peak RSS GiB | above baseline GiB"
            + " | peak anon GiB (baseline) | peak file-backed GiB"
            + (" | peak GPU GiB" if gpu else "")
            + " | offloaded | load s | compress s | save s | achieved |",
            "| --- | --- |"
            + (" --- |" if _concurrent(offload) else "")
            + " ---: |" * (11 + (1 if gpu else 0))
            + " --- |",
        ]
        for r in offload:
            recipe = f"`{r['recipe']}`" + (f" | {run_cell(r)}" if _concurrent(offload) else "")
            if r["status"] != "ok":
                lines.append(
                    f"| {r['shape']} | {recipe} | {_gb(r['weights_mb'])} | {r['max_memory']} | "
                    f"{_gb(base.get('peak_rss_mb'))} | **{r['status']}**: {r.get('reason', '')} |"
                )
                continue
            lines.append(
                f"| {r['shape']} | {recipe} | {_gb(r['weights_mb'])} | {r['max_memory']} | "
                f"{_gb(base.get('peak_rss_mb'))} | {_gb(r['peak_rss_mb'])} | {_gb(r.get('peak_rss_above_baseline_mb'))}"
                + f" | {_gb(r.get('peak_anon_mb'))} ({_gb(base.get('peak_anon_mb'))}) | {_gb(r.get('peak_file_mb'))}"
                + (f" | {_gb(r['peak_gpu_mb'])}" if gpu else "")
                + f" | {r['offloaded']} | {_num(r['load_s'])} | {_num(r['compress_s'])} | {_num(r['save_s'])} | "
                f"{'-' if r['achieved'] is None else format(r['achieved'], '.2%')} |"
            )
        lines.append("")
    if result.get("analysis"):  # written by people after the run (kept in the json, rendered with --render)
        lines += ["## Reading these numbers", "", *(f"- {a}" for a in result["analysis"]), ""]
    if result.get("cuts"):
        lines += ["## Left out", "", *(f"- {c}" for c in result["cuts"]), ""]
    notes = sorted({n for r in rows for n in r.get("notes", []) if "calibration and perplexity" not in n})
    if notes:
        lines += ["## Notes from the runs", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def write_result(result: dict[str, Any], base: Path) -> None:
    """``BASE.json`` and ``BASE.md`` of ``result``, each written atomically."""
    write_results(base, result, markdown(result))
