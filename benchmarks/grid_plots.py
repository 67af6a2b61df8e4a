"""The grid's plots: quality against parameters removed, and per-layer widths per target ratio.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.core.tables import pyplot, series_color
from benchmarks.seeds import NORM_MEAN, decision_rows
from benchmarks.tables import ok_rows, series_name

PARAMS_KEY = "layer params (% of dense)"


def plot_quality(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Perplexity (and mean zero-shot accuracy) against the fraction of parameters removed, one line per
    recipe and recovery setting; dense is the star at 0."""
    ok = ok_rows(decision_rows(rows))
    mean = NORM_MEAN if any(NORM_MEAN in r.get("metrics", {}) for r in ok) else "zeroshot_mean_acc"
    metrics = [m for m in ("wikitext2_ppl", "ptb_ppl", mean) if any(m in r.get("metrics", {}) for r in ok)]
    compressed = [r for r in ok if r["id"] != "dense" and r.get("params", {}).get("removed_ratio") is not None]
    if not metrics or not compressed:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.8), squeeze=False)
    series: dict[str, list[dict[str, Any]]] = {}
    for row in compressed:
        series.setdefault(series_name(row), []).append(row)
    dense = next((r for r in ok if r["id"] == "dense"), None)
    for axis, metric in zip(axes[0], metrics, strict=True):
        for index, (name, members) in enumerate(series.items()):
            points = sorted(
                (100 * r["params"]["removed_ratio"], r["metrics"][metric])
                for r in members
                if isinstance(r.get("metrics", {}).get(metric), int | float) and math.isfinite(r["metrics"][metric])
            )
            if points:
                style = "--" if name.endswith("+ LoRA") else "-"
                axis.plot(*zip(*points, strict=True), style, marker="o", color=series_color(plt, index), label=name)
        if dense and isinstance(dense.get("metrics", {}).get(metric), int | float):
            axis.plot([0], [dense["metrics"][metric]], "k*", markersize=12, label="dense")
        if metric.endswith("_ppl"):
            axis.set_yscale("log")
        axis.set_xlabel("parameters removed (%)")
        axis.set_ylabel(metric.replace("_", " "))
        axis.grid(alpha=0.3)
    # One legend for every series: a series missing from the last panel (no zero-shot there) is still named.
    handles: dict[str, object] = {}
    for axis in axes[0]:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    axes[0][-1].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("quality against parameters removed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _layer_series(row: dict[str, Any]) -> dict[str, list[float]]:
    layers = row.get("layers") or {}
    widths = layers.get("widths") or []
    keys = [k for k in (widths[0] if widths else {}) if all(isinstance(w.get(k), int | float) for w in widths)]
    series = {k: [w[k] for w in widths] for k in keys}
    params, dense = layers.get("params"), layers.get("dense_params")
    if params and dense and len(params) == len(dense):
        series[PARAMS_KEY] = [100 * a / b if b else 0.0 for a, b in zip(params, dense, strict=True)]
    return series


def plot_widths(rows: list[dict[str, Any]], base: Path) -> list[Path]:
    """Per-layer widths of every compressed model, one figure per target ratio (``BASE-widths-rPCT.png``):
    a panel per width (heads, KV heads, MLP width, ...) and per-layer
    parameters as a percentage of the dense layer's, one line per row, dense dashed. Widths no model
    changes are left out. A seeded row is drawn once (its first seed's widths)."""
    ok = ok_rows(decision_rows(rows))
    dense = next((r for r in ok if r["id"] == "dense"), None)
    by_ratio: dict[float, list[dict[str, Any]]] = {}
    for row in ok:
        if row["id"] != "dense" and _layer_series(row):
            by_ratio.setdefault(row["ratio"], []).append(row)
    paths: list[Path] = []
    if not by_ratio:
        return paths
    plt = pyplot()
    dense_series = _layer_series(dense) if dense else {}
    for ratio, members in sorted(by_ratio.items()):
        all_series = [_layer_series(r) for r in members]
        # Only the widths some model changes (heads, MLP width, ...), and always the per-layer parameters.
        keys = list(dict.fromkeys(k for s in all_series for k in s))
        keys = [k for k in keys if k == PARAMS_KEY or any(s.get(k) != dense_series.get(k) for s in all_series)]
        fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.3 * len(keys) + 0.6), sharex=True, squeeze=False)
        for axis, key in zip(axes[:, 0], keys, strict=True):
            if key in dense_series:
                axis.plot(dense_series[key], "k--", linewidth=1, label="dense")
            for index, (row, series) in enumerate(zip(members, all_series, strict=True)):
                if key in series:
                    axis.plot(series[key], drawstyle="steps-mid", color=series_color(plt, index), label=row["id"])
            axis.set_ylabel(key.replace("_", " "), fontsize=8)
            axis.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes[-1, 0].set_xlabel("layer")
        fig.suptitle(f"per-layer widths, target ratio {ratio:.0%}")
        fig.tight_layout()
        path = base.parent / f"{base.name}-widths-r{round(ratio * 100, 6):g}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
