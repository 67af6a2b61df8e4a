"""The grid's Markdown tables (its plots: ``benchmarks/grid_plots.py``), written from the result dictionary alone
(what ``benchmarks.run`` writes as JSON; missing fields tolerated, so a partial run has tables too);
``python -m benchmarks.tables RESULT.json`` prints the compact ones (for the README).

Seeded rows (:mod:`benchmarks.seeds`): the summary, quality and pivot tables and the plots show one line per row as
the claims see it, a seeded row as ``mean [min-max]`` with its number of draws; the "Seeds" section lists every
seed's value; the size, cost and speed tables list every compression (each seed its own line). Zero-shot cells are
``acc_norm`` where lm-eval defines it (else ``acc``), and the mean column is ``zeroshot_mean_acc_norm``
(``zeroshot_mean_acc`` for rows without it).

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.inputs import read_json_file
from benchmarks.core.tables import MISSING, cell, percent
from benchmarks.seeds import NORM_MEAN, decision_rows


def ok_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that ran (``status: ok``)."""
    return [r for r in rows if r.get("status") == "ok"]


def _label(row: dict[str, Any]) -> str:
    return f"`{row['id']}`"


def _target(row: dict[str, Any]) -> str:
    if row.get("ratio") is None:
        return MISSING
    return f"{row['ratio']:.0%} of {row.get('of') or '?'}"


def series_name(row: dict[str, Any]) -> str:
    """A row's line in the pivot table and the quality plot: its recipe, ``+ LoRA`` with recovery."""
    return f"{row['recipe']} + LoRA" if row.get("recovery") else row["recipe"]


def placement_text(settings: dict[str, Any], machine: dict[str, Any]) -> str:
    """Where the rows were compressed and evaluated, and in which dtype ("float32, CPU", "float32, CUDA
    (NVIDIA H100 80GB HBM3)"): the settings' device and dtype resolved as ``auto`` resolves them."""
    gpu = machine.get("gpu") or {}
    device = settings.get("device") or "auto"
    on_gpu = device.startswith("cuda") or (device == "auto" and bool(gpu))
    dtype = settings.get("dtype") or "auto"
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    return _place(dtype, gpu.get("gpu") if on_gpu else None, on_gpu)


def _place(dtype: str, gpu: str | None, on_gpu: bool) -> str:
    return f"{dtype}, CUDA ({gpu or 'GPU'})" if on_gpu else f"{dtype}, CPU"


def measured_on(result: dict[str, Any]) -> str:
    """Where the rows were measured: the distinct placements their run reports state (``placement``), else
    the settings' device and dtype on the benchmark's machine."""
    places = []
    for row in result.get("rows", []):
        placement = row.get("placement") or {}
        if placement.get("device"):
            place = _place(placement.get("dtype", "?"), placement.get("gpu"), placement["device"].startswith("cuda"))
            if place not in places:
                places.append(place)
    return "; ".join(places) or placement_text(result.get("settings", {}), result.get("machine", {}))


def settings_text(result: dict[str, Any]) -> list[str]:
    s = result.get("settings", {})
    machine = result.get("machine", {})
    speed = s.get("speed", {})
    windows = s.get("ppl_tokens", 0) // max(s.get("ppl_window", 1), 1)
    datasets = ", ".join(s.get("ppl_datasets", []))
    reused = "--reuse-only" in result.get("command", "")
    lines = [
        f"Model `{s.get('model')}`, {measured_on(result)}, seed as in each recipe (seeded rows: each seed "
        "listed). "
        f"Command: `{result.get('command', '')}`.",
        "",
        f"- Perplexity ({datasets}): the first {windows} non-overlapping windows of {s.get('ppl_window')} tokens "
        f"({s.get('ppl_tokens', 0):,} tokens) of each test text.",
    ]
    if s.get("zeroshot_tasks") and s.get("zeroshot_limit") != 0:
        limit = s.get("zeroshot_limit")
        first = "every example" if limit is None else f"the first {limit} examples"
        lines.append(
            f"- Zero-shot (lm-eval, local task files): {first} of each of {', '.join(s['zeroshot_tasks'])} "
            f"(`--limit {limit}`); acc_norm per task where lm-eval defines it (piqa, hellaswag, arc_easy, "
            f"arc_challenge, openbookqa), acc where it does not (boolq, winogrande), and their mean "
            f"(`{NORM_MEAN}`; the claims use it)."
        )
    else:
        lines.append("- Zero-shot: skipped in this run.")
    lines += [
        f"- Speed: batch {speed.get('batch')}, {speed.get('prompt_len')}-token prompt, "
        f"{speed.get('new_tokens')} greedy tokens; each model interleaved with dense in the same process, "
        f"median of {speed.get('rounds')} rounds, "
        f"{machine.get('torch_threads')} threads. Ratios are for this machine and run.",
        "- Compression ran as one `slimkit recipe run --no-eval` process per row (peak RSS is that process's); "
        'evaluation and speed ran in the benchmark process on the saved model. "compress s" is calibration '
        'plus the recipe\'s stages (not loading or saving); "process wall s" is the whole process.',
        f"- Machine{' that assembled the rows (measured where the first line says)' if reused else ''}: "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{cell(machine.get('memory_gb'), '.0f')} GB; {machine.get('platform', '')}; "
        f"Python {machine.get('python', '')}"
        + (
            f"; GPU {machine['gpu']['gpu']} ({machine['gpu'].get('gpu_memory_gib')} GiB, CUDA "
            f"{machine['gpu'].get('cuda')})."
            if machine.get("gpu")
            else "."
        ),
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items()) + ".",
        f"- Benchmark wall time: {cell(result.get('wall_s'), '.0f')} s{_load_text(machine)}; peak RSS of the "
        f"benchmark process (evaluation and speed) {cell(result.get('bench_peak_rss_mb'), '.0f')} MB.",
    ]
    rows = result.get("rows", [])
    seeded = [r for r in decision_rows(rows) if "draws" in r]
    lines.append(
        '- Draws: a row without seeds is one compression with its recipe\'s seed ("1 draw")'
        + (
            f"; seeded rows ({len(seeded)}) ran once per seed (`--set seed=N`) and show the mean [min-max] "
            "over the seeds that finished (every value in the Seeds section)."
            if seeded
            else "."
        )
    )
    lines.append(
        "- Claims: a comparison `A < F * B` holds when it holds for every pairing of A's and B's draws (A's "
        "worst seed against B's best), does not hold when it fails for every pairing, and is within noise "
        "otherwise; between two single draws it is decided by their one pairing. A claim does not hold if "
        "any of its comparisons does not, is within noise if any is, and holds otherwise."
    )
    reused_rows = [r for r in rows if r.get("evaluation_reused")]
    if reused_rows:
        lines.append(
            f"- {len(reused_rows)} of {len(rows)} rows were measured by earlier `--resume` runs under the same "
            "settings and kept folder (`bench-row.json`); their evaluation, speed and cost numbers are those runs'."
        )
    return lines


def _load_text(machine: dict[str, Any]) -> str:
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    if not start:
        return ""
    text = f"; 1-minute load average {start[0]:.1f} at the start"
    text += f", {end[0]:.1f} at the end" if end else ""
    cores = machine.get("cores")
    return text + (f" on {cores} cores (a load above the benchmark's own means shared cores)" if cores else "")


NORM_TASKS = ("piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa")
"""Tasks for which lm-eval defines ``acc_norm``."""


def _task_metric(row: dict[str, Any], task: str) -> str:
    return f"{task}_acc_norm" if f"{task}_acc_norm" in row.get("metrics", {}) else f"{task}_acc"


def _mean_metric(row: dict[str, Any]) -> str:
    return NORM_MEAN if NORM_MEAN in row.get("metrics", {}) else "zeroshot_mean_acc"


def _cell(row: dict[str, Any], metric: str, spec: str = ".4g") -> str:
    """The metric, as ``mean [min-max]`` for a seeded row."""
    value = cell(row.get("metrics", {}).get(metric), spec)
    spread = (row.get("spread") or {}).get(metric)
    if spread is None or len(spread.get("values", [])) < 2:
        return value
    return f"{value} [{cell(spread['min'], spec)}-{cell(spread['max'], spec)}]"


def _draws(row: dict[str, Any]) -> str:
    if "draws" not in row:
        return "1"
    asked = f" of {len(row.get('seeds', []))}" if row.get("seeds_missing") else ""
    return f"{row['draws']}{asked} seed{'' if row['draws'] == 1 and not asked else 's'}"


def _task_head(task: str) -> str:
    return f"{task} (norm)" if task in NORM_TASKS else task


def quality_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    datasets = settings.get("ppl_datasets", [])
    tasks = settings.get("zeroshot_tasks", []) if settings.get("zeroshot_limit") != 0 else []
    head = ["row", "target", "draws", "params removed", *(f"{d} ppl" for d in datasets), *map(_task_head, tasks)]
    if tasks:
        head.append("mean acc")
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
    for row in ok_rows(decision_rows(rows)):
        cells = [_label(row), _target(row), _draws(row), percent(row.get("params", {}).get("removed_ratio"))]
        cells += [_cell(row, f"{d}_ppl") for d in datasets]
        cells += [_cell(row, _task_metric(row, t), ".3f") for t in tasks]
        if tasks:
            cells.append(_cell(row, _mean_metric(row), ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def seeds_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """Every seeded row's metrics: mean, min-max and each seed's value."""
    groups = [r for r in decision_rows(rows) if "draws" in r]
    if not groups:
        return []
    datasets = settings.get("ppl_datasets", [])
    lines = ["| row | seeds | metric | mean | min-max | values (by seed) |", "| --- | --- | --- | ---: | --- | --- |"]
    for row in groups:
        seeds = ", ".join(str(s) for s in row.get("seeds_ok", []))
        if row.get("status") != "ok":
            lines.append(f"| {_label(row)} | {seeds or '-'} | - | - | - | {row.get('reason', '')} |")
            continue
        metrics = [f"{d}_ppl" for d in datasets] + [_mean_metric(row)]
        for metric in (m for m in metrics if m in row.get("spread", {})):
            spread, spec = row["spread"][metric], ".3f" if "_acc" in metric else ".4g"
            values = ", ".join(cell(v, spec) for v in spread["values"])
            lines.append(
                f"| {_label(row)} | {seeds} | {metric} | {cell(row['metrics'][metric], spec)} | "
                f"{cell(spread['min'], spec)}-{cell(spread['max'], spec)} | {values} |"
            )
    return lines


def summary_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """One line per row: what was removed, quality, MACs, speed against dense and the compression cost."""
    datasets = settings.get("ppl_datasets", [])
    zeroshot = bool(settings.get("zeroshot_tasks")) and settings.get("zeroshot_limit") != 0
    head = ["row", "params removed", *(f"{d} ppl" for d in datasets), *(["mean acc"] if zeroshot else [])]
    head += ["MACs kept", "prefill vs dense", "decode vs dense", "compress s", "peak MB"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for row in ok_rows(decision_rows(rows)):
        macs, speed, cost = row.get("macs", {}), row.get("speed", {}), row.get("cost", {})
        kept = macs["after"] / macs["before"] if macs.get("before") and macs.get("after") is not None else None
        label = _label(row) + (f" ({_draws(row)})" if "draws" in row else "")
        cells = [label, percent(row.get("params", {}).get("removed_ratio"))]
        cells += [_cell(row, f"{d}_ppl") for d in datasets]
        cells += [_cell(row, _mean_metric(row), ".3f")] if zeroshot else []
        cells += [percent(kept, 1), cell(speed.get("prefill_ratio"), ".2f"), cell(speed.get("decode_ratio"), ".2f")]
        cells += [cell(cost.get("compress_s"), ".0f"), cell(cost.get("peak_rss_mb"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pivot_table(rows: list[dict[str, Any]], metric: str, spec: str = ".4g") -> list[str]:
    """``metric`` with one line per recipe and recovery setting and one column per target ratio (a seeded
    row as ``mean [min-max]``)."""
    ok = [r for r in ok_rows(decision_rows(rows)) if r.get("ratio") is not None]
    ratios = sorted({r["ratio"] for r in ok})
    table: dict[str, dict[float, Any]] = {}
    for row in ok:
        table.setdefault(series_name(row), {})[row["ratio"]] = _cell(row, metric, spec)
    dense = next((r for r in ok_rows(rows) if r["id"] == "dense"), None)
    lines = [f"| recipe | {' | '.join(f'{x:.0%}' for x in ratios)} |", "| --- |" + " ---: |" * len(ratios)]
    if dense:
        value = cell(dense.get("metrics", {}).get(metric), spec)
        lines.append("| dense | " + " | ".join(value if i == 0 else "" for i in range(len(ratios))) + " |")
    for name, values in table.items():
        lines.append(f"| `{name}` | " + " | ".join(values.get(x, MISSING) for x in ratios) + " |")
    return lines


def size_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row | params before | params after | removed | achieved (of target) | MACs before | MACs after | "
        "MACs kept | residual params | low-rank params |",
        "| --- |" + " ---: |" * 9,
    ]
    for row in ok_rows(rows):
        p, m, s = row.get("params", {}), row.get("macs", {}), row.get("structure", {})
        kept = m["after"] / m["before"] if m.get("before") and m.get("after") is not None else None
        lines.append(
            f"| {_label(row)} | {cell(p.get('before'), ',')} | {cell(p.get('after'), ',')} | "
            f"{percent(p.get('removed_ratio'))} | {percent(row.get('achieved'))} | {cell(m.get('before'), '.4g')} | "
            f"{cell(m.get('after'), '.4g')} | {percent(kept, 1)} | {cell(s.get('residual_params'), ',')} | "
            f"{cell(s.get('lowrank_params'), ',')} |"
        )
    return lines


def _stages_text(stages: dict[str, float]) -> str:
    return "; ".join(f"{k} {v:.0f}" for k, v in stages.items()) or MISSING


def cost_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row | compress s | per stage s | process wall s | peak RSS MB | calibration | recovery tokens |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for row in ok_rows(rows):
        c = row.get("cost")
        if not c:
            continue
        cal = c.get("calibration") or {}
        if cal.get("samples"):
            calibration = f"{cal['samples']} x {cal.get('seq_len', '?')} = {cell(cal.get('tokens'), ',')} tokens"
            calibration += f" of {cal['dataset']}" if cal.get("dataset") else ""
        else:
            calibration = "none"
        if c.get("extra_calibration_tokens"):
            calibration += f" (+{c['extra_calibration_tokens']:,} in stages)"
        lines.append(
            f"| {_label(row)} | {cell(c.get('compress_s'), '.1f')} | {_stages_text(c.get('stages_s', {}))} | "
            f"{cell(c.get('process_wall_s'), '.0f')} | {cell(c.get('peak_rss_mb'), '.0f')} | {calibration} | "
            f"{cell(c.get('recovery_tokens'), ',')} |"
        )
    return lines


def speed_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row | prefill tok/s | decode tok/s | dense prefill tok/s | dense decode tok/s | prefill vs dense | "
        "decode vs dense |",
        "| --- |" + " ---: |" * 6,
    ]
    for row in ok_rows(rows):
        s = row.get("speed")
        if not s:
            continue
        lines.append(
            f"| {_label(row)} | {cell(s.get('prefill_tokens_per_s'), '.1f')} | "
            f"{cell(s.get('decode_tokens_per_s'), '.1f')} | {cell(s.get('dense_prefill_tokens_per_s'), '.1f')} | "
            f"{cell(s.get('dense_decode_tokens_per_s'), '.1f')} | "
            f"{cell(s.get('prefill_ratio'), '.2f')} | {cell(s.get('decode_ratio'), '.2f')} |"
        )
    return lines


def cause_text(claim: dict[str, Any]) -> str:
    """The claim's cause when its verdict is not "holds", then its note."""
    parts = []
    if claim.get("cause") and claim.get("verdict") != "holds":
        parts.append(claim["cause"])
    if claim.get("note"):
        parts.append(f"Note: {claim['note']}")
    return " ".join(parts).replace("|", "/") or MISSING


def claims_table(claims: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| claim | source | checks | verdict | cause / note | evidence |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in claims:
        evidence = "<br>".join(c.get("evidence", []) + [f"not run at {m}" for m in c.get("not_run", [])])
        metrics = ", ".join(c.get("metrics", []))
        checks = "; ".join(f"`{x}`" for x in c.get("checks", [])) + f" ({metrics})"
        verdict = f"**{c['verdict']}**" if c["verdict"] != "not run" else c["verdict"]
        lines.append(
            f"| {c['claim']} | {c['source']} | {checks} | {verdict} | {cause_text(c)} | {evidence or MISSING} |"
        )
    return lines


def skipped_table(rows: list[dict[str, Any]]) -> list[str]:
    skipped = [r for r in rows if r.get("status") != "ok"]
    if not skipped:
        return []
    lines = ["| row | status | reason |", "| --- | --- | --- |"]
    lines += [f"| {_label(r)} | {r['status']} | {str(r.get('reason', '')).replace('|', '/')} |" for r in skipped]
    return lines


def markdown(result: dict[str, Any], plots: list[str]) -> str:
    rows, settings = result.get("rows", []), result.get("settings", {})
    out = [f"# Benchmark `{result.get('name')}` ({result.get('date')})", "", *settings_text(result), ""]
    sections = [
        ("Summary", summary_table(rows, settings)),
        ("Quality", quality_table(rows, settings)),
        ("Size", size_table(rows)),
        ("Cost of compression", cost_table(rows)),
        ("Speed of the result", speed_table(rows)),
        ("Paper claims", claims_table(result.get("claims", []))),
        ("Seeds", seeds_table(rows, settings)),
        ("Not run or failed", skipped_table(rows)),
    ]
    for title, lines in sections:
        if len(lines) > 2 or (lines and title == "Not run or failed"):
            out += [f"## {title}", "", *lines, ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out)


def _add_mean_without(rows: list[dict[str, Any]], tasks: list[str], left_out: str) -> None:
    """Each row's mean zero-shot accuracy over ``tasks`` without ``left_out`` (a task whose answers a
    pruned model can flip to the majority class wholesale, e.g. BoolQ), as ``zeroshot_mean_acc_without_X``."""
    kept = [t for t in tasks if t != left_out]
    if left_out not in tasks or not kept:
        return
    for row in ok_rows(rows):
        metrics = row.setdefault("metrics", {})
        values = [metrics.get(f"{t}_acc") for t in kept]
        if all(isinstance(v, int | float) for v in values):
            metrics[f"zeroshot_mean_acc_without_{left_out}"] = sum(values) / len(values)


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.tables", "The compact tables of a grid result (for the README).")
    parser.add_argument("result", type=arg.input_file, help="a grid result (benchmarks.run's JSON)")
    result = read_json_file(parser.parse(argv).result, "RESULT")
    rows, settings = result.get("rows", []), result.get("settings", {})
    out = [*summary_table(rows, settings), ""]
    _add_mean_without(rows, settings.get("zeroshot_tasks", []), "boolq")
    for metric in ("wikitext2_ppl", NORM_MEAN, "zeroshot_mean_acc", "zeroshot_mean_acc_without_boolq"):
        if any(metric in r.get("metrics", {}) for r in ok_rows(decision_rows(rows))):
            out += [f"{metric}:", "", *pivot_table(rows, metric, ".3f" if "_acc" in metric else ".4g"), ""]
    out += ["| claim | source | verdict | cause when it does not hold |", "| --- | --- | --- | --- |"]
    out += [f"| {c['claim']} | {c['source']} | {c['verdict']} | {cause_text(c)} |" for c in result.get("claims", [])]
    print("\n".join(out))


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.tables RESULT.json``: the compact tables of a result (for the README)."""
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
