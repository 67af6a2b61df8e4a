"""Writing a run's :class:`~slimkit.engine.report.RunReport` as ``report.json`` and ``report.md``, with a per-layer
width plot (low-rank ranks and residual maps included when the saved model has them)."""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from slimkit.engine.report import MemoryPlanReport, PlacementReport, RunReport
from slimkit.primitives.datasets.data_paths import cache_root
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import result_lines
from slimkit.primitives.io.describe import Structure, saved_structure

_ROLE_COLOURS = {
    "q": "#1f77b4",
    "k": "#ff7f0e",
    "v": "#2ca02c",
    "o": "#d62728",
    "gate": "#9467bd",
    "up": "#8c564b",
    "down": "#e377c2",
}


def plot_widths(
    before: list[dict[str, int]], after: list[dict[str, int]], path: Path, structure: Structure | None = None
) -> None:
    """Bars of every per-layer width before and after; with a :class:`Structure` (low-rank pairs,
    residual maps) an extra panel of each low-rank pair's rank per role and layer, and dashed lines
    where residual / basis-change maps sit (before the layer whose input they map; at the right edge
    for maps outside the layers, e.g. on the final norm)."""
    if "MPLCONFIGDIR" not in os.environ:  # matplotlib's font cache under slimkit's cache folder, not the home folder
        with suppress(SlimkitError):
            os.environ["MPLCONFIGDIR"] = str(cache_root() / "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = [k for k in dict.fromkeys(k for w in before for k in w) if k != "head_dim"]  # a hybrid's layers differ
    has_ranks = structure is not None and bool(structure.ranks)
    panels = len(keys) + int(has_ranks)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.2 * panels), sharex=True, squeeze=False)
    axes = axes[:, 0]
    layers = list(range(len(before)))
    for axis, key in zip(axes, keys, strict=False):
        axis.bar(layers, [w.get(key, 0) for w in before], color="#d0d0d0", label="before")
        axis.bar(layers, [w.get(key, 0) for w in after], color="#3b75af", label="after")
        axis.set_ylabel(key.replace("_", " "), fontsize=8)
    if structure is not None and has_ranks:
        axis = axes[-1]
        roles = [r for r in _ROLE_COLOURS if any(r in ranks for ranks in structure.ranks.values())]
        for role in roles:
            points = [(layer, ranks[role]) for layer, ranks in structure.ranks.items() if role in ranks]
            axis.plot(
                [x for x, _ in points],
                [y for _, y in points],
                marker="o",
                markersize=3,
                linewidth=1,
                color=_ROLE_COLOURS[role],
                label=role,
            )
        axis.set_ylabel("low-rank rank", fontsize=8)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7, loc="lower right", ncol=len(roles), title="role", title_fontsize=7)
    if structure is not None and structure.residual_maps:
        spots = sorted({(m.layer if m.layer is not None else len(before)) - 0.5 for m in structure.residual_maps})
        for axis in axes:
            for x in spots:
                axis.axvline(x, color="#c0392b", linestyle="--", linewidth=1)
        axes[0].plot([], [], color="#c0392b", linestyle="--", linewidth=1, label="residual map")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("layer")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("per-layer widths" + (" and low-rank ranks" if has_ranks else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(report: RunReport, plot_name: str | None, structure: Structure | None = None) -> str:
    p, m, t = report.params, report.macs, report.target
    lines = [
        f"# slimkit report: {report.recipe} on {report.model}",
        "",
        f"Target: remove {t.ratio:.1%} of {t.of}; achieved {t.achieved:.2%}. Seed {report.seed}."
        + (f" Widths aligned: {', '.join(f'{k} {v}' for k, v in t.align.items())}." if t.align else ""),
        "",
        "| | before | after | removed |",
        "| --- | ---: | ---: | ---: |",
        f"| parameters | {_fmt(p.before)} | {_fmt(p.after)} | {p.removed_ratio:.2%} |",
        f"| MACs ({m.seq_len} tokens) | {_fmt(m.before)} | {_fmt(m.after)} | {1 - m.after / m.before:.2%} |",
    ]
    for part in ("attention", "mlp", "layers", "embeddings"):
        b, a = p.by_part_before[part], p.by_part_after[part]
        lines.append(f"| {part} parameters | {_fmt(b)} | {_fmt(a)} | {(1 - a / b) if b else 0:.2%} |")
    if report.metrics:
        lines += _metric_table(report)
    if report.evaluation.get("perplexity"):
        lines += ["", "Perplexity settings:"]
        for item in report.evaluation["perplexity"]:
            lines.append(
                f"- {item['dataset']}: {item['windows']} non-overlapping windows of {item['seq_len']} tokens "
                f"({item['tokens']:,} tokens)"
            )
    if report.calibration:
        c = report.calibration
        lines += ["", f"Calibration: {c['samples']} x {c['seq_len']} tokens of {c['dataset']} (seed {c['seed']})."]
    lines += ["", "| stage | seconds |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report.timings_s.stages.items()]
    lines += [f"| total | {report.timings_s.total:.1f} |", "", f"Peak resident memory: {report.peak_rss_mb:.0f} MB."]
    lines.append(_placement_line(report.placement))
    if report.memory_plan is not None:
        lines.append(_memory_plan_line(report.memory_plan))
    if structure is not None and not structure.empty:
        lines += ["", f"Structure: {structure.summary()}."]
    for note in report.notes:
        lines.append(f"\n> {note}")
    if report.loaders:
        lines += ["", "Readable by:"]
        lines += [f"- {v['loader']}: {v['answer']} ({v['detail']})" for v in report.loaders]
    for item in report.export or []:
        lines += ["", f"Export {item['format']} to {item['path']}:"]
        if "error" in item:
            lines.append(f"- FAILED: {item['error']}")
        else:
            lines += [f"- {line}" for line in result_lines(item)]
    if plot_name:
        lines += ["", f"![per-layer widths]({plot_name})"]
    if report.metrics:
        lines += ["", *report.comparison_lines()]
    return "\n".join(lines) + "\n"


def _metric_table(report: RunReport) -> list[str]:
    """The metrics, with the dense model's beside them when the report has them."""
    if report.dense is None:
        return [
            "",
            "| metric | value |",
            "| --- | ---: |",
            *[f"| {k} | {_fmt(v)} |" for k, v in report.metrics.items()],
        ]
    dense = report.dense.metrics
    lines = ["", "| metric | value | dense | value / dense |", "| --- | ---: | ---: | ---: |"]
    for key, value in report.metrics.items():
        known = dense.get(key)
        lines.append(
            f"| {key} | {_fmt(value)} | {_fmt(known) if known is not None else '-'} | "
            f"{f'{value / known:.2f}x' if known else '-'} |"
        )
    origin = "cached from an earlier run" if report.dense.cached else "measured in this run before compression"
    return [*lines, "", f"Dense metrics: the uncompressed model, same evaluation settings ({origin})."]


def _memory_plan_line(plan: MemoryPlanReport) -> str:
    """``Memory plan (checked before loading): about 6.0 GiB at its peak: weights 2.3 + prune 3.7 (gradient sums
    ..., activations ...).``"""
    line = f"Memory plan (checked before loading): about {plan.peak_gib:.1f} GiB at its peak: weights "
    line += f"{plan.weights_gib:.1f}"
    stage = next((s for s in plan.stages if s.stage == plan.peak_stage), None)
    if stage is not None:
        parts = ", ".join(f"{name.replace('_', ' ')} {value:.1f}" for name, value in stage.parts_gib.items() if value)
        line += f" + {stage.stage} {stage.total_gib:.1f}" + (f" ({parts})" if parts else "")
        if stage.released_gib:
            line += f" - the weights it releases {stage.released_gib:.1f}"
    return line + "."


def _placement_line(placement: PlacementReport) -> str:
    extra = placement.model_extra or {}
    where = placement.device + (f" ({extra['gpu']})" if extra.get("gpu") else "")
    line = f"Ran on {where} in {placement.dtype}"
    if placement.peak_gpu_mb is not None:
        line += f"; peak GPU memory {placement.peak_gpu_mb:.0f} MB"
    if extra.get("max_memory"):
        offloaded = "layers offloaded, one at a time on the device" if placement.offloaded else "all fitted"
        line += f"; weights' budget {extra['max_memory']} ({offloaded})"
    if placement.save_dtype:
        line += f"; saved in {placement.save_dtype}"
    return line + "."


def write_report(report: RunReport, folder: Path) -> str:
    """Write ``report.json``, ``report.md`` and ``widths.png`` into ``folder``; returns the markdown.

    The low-rank ranks and residual maps of the plot (and the report's structure line) come from the
    saved model's manifest, ``folder/model/slimkit_manifest.json``, when there is one.
    """
    plot_name = "widths.png"
    structure = saved_structure(folder / "model")
    before = [w.model_dump() for w in report.layers.before]
    after = [w.model_dump() for w in report.layers.after]
    plot_widths(before, after, folder / plot_name, structure)
    (folder / "report.json").write_text(json.dumps(report.as_json(), indent=2) + "\n")
    text = markdown(report, plot_name, structure)
    (folder / "report.md").write_text(text)
    return text
