"""Writing ``report.json`` and ``report.md`` (with a per-layer width plot) for a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_widths(before: list[dict[str, int]], after: list[dict[str, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in before[0] if k != "head_dim"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.2 * len(keys)), sharex=True)
    layers = list(range(len(before)))
    for axis, key in zip(axes, keys, strict=True):
        axis.bar(layers, [w[key] for w in before], color="#d0d0d0", label="before")
        axis.bar(layers, [w[key] for w in after], color="#3b75af", label="after")
        axis.set_ylabel(key.replace("_", " "), fontsize=8)
    axes[0].legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("layer")
    fig.suptitle("per-layer widths")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(report: dict[str, Any], plot_name: str | None) -> str:
    p, m, t = report["params"], report["macs"], report["target"]
    lines = [
        f"# slimkit report: {report['recipe']} on {report['model']}",
        "",
        f"Target: remove {t['ratio']:.1%} of {t['of']}; achieved {t['achieved']:.2%}. Seed {report['seed']}.",
        "",
        "| | before | after | removed |",
        "| --- | ---: | ---: | ---: |",
        f"| parameters | {_fmt(p['before'])} | {_fmt(p['after'])} | {p['removed_ratio']:.2%} |",
        f"| MACs ({m['seq_len']} tokens) | {_fmt(m['before'])} | {_fmt(m['after'])} | "
        f"{1 - m['after'] / m['before']:.2%} |",
    ]
    for part in ("attention", "mlp", "layers", "embeddings"):
        b, a = p["by_part_before"][part], p["by_part_after"][part]
        lines.append(f"| {part} parameters | {_fmt(b)} | {_fmt(a)} | {(1 - a / b) if b else 0:.2%} |")
    if report["metrics"]:
        lines += ["", "| metric | value |", "| --- | ---: |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in report["metrics"].items()]
    if report.get("evaluation", {}).get("perplexity"):
        lines += ["", "Perplexity settings:"]
        for item in report["evaluation"]["perplexity"]:
            lines.append(
                f"- {item['dataset']}: {item['windows']} non-overlapping windows of {item['seq_len']} tokens "
                f"({item['tokens']:,} tokens)"
            )
    if report.get("calibration"):
        c = report["calibration"]
        lines += ["", f"Calibration: {c['samples']} x {c['seq_len']} tokens of {c['dataset']} (seed {c['seed']})."]
    lines += ["", "| stage | seconds |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["timings_s"]["stages"].items()]
    lines += [
        f"| total | {report['timings_s']['total']:.1f} |",
        "",
        f"Peak resident memory: {report['peak_rss_mb']:.0f} MB.",
    ]
    for note in report.get("notes", []):
        lines.append(f"\n> {note}")
    if plot_name:
        lines += ["", f"![per-layer widths]({plot_name})"]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], folder: Path) -> None:
    plot_name = "widths.png"
    plot_widths(report["layers"]["before"], report["layers"]["after"], folder / plot_name)
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "report.md").write_text(markdown(report, plot_name))
