"""The search's picture: every candidate's score per layer, one panel per sub-block, the chosen ones marked.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_scores(
    scores: Mapping[str, Mapping[int, Mapping[str, float]]], chosen: Mapping[str, Mapping[int, str]], path: Path
) -> None:
    """Write a PNG of ``scores[part][layer][candidate]`` (KL, log scale; the parent, at 0, is left out) with
    ``chosen[part][layer]`` circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [part for part in ("attention", "mlp") if scores.get(part)]
    figure, axes = plt.subplots(len(parts) or 1, 1, figsize=(10, 3.2 * max(len(parts), 1)), squeeze=False)
    for axis, part in zip(axes[:, 0], parts, strict=False):
        kinds: dict[str, tuple[list[int], list[float]]] = {}
        for layer, candidates in sorted(scores[part].items()):
            for name, value in candidates.items():
                if name == "dense":
                    continue
                xs, ys = kinds.setdefault(name.split(":")[0], ([], []))
                xs.append(layer)
                ys.append(max(value, 1e-6))
        for kind, (xs, ys) in sorted(kinds.items()):
            axis.scatter(xs, ys, s=12, label=kind, alpha=0.7)
        picked = [
            (layer, max(scores[part][layer][name], 1e-6))
            for layer, name in sorted(chosen.get(part, {}).items())
            if name != "dense"
        ]
        if picked:
            axis.scatter(*zip(*picked, strict=True), s=70, facecolors="none", edgecolors="black", label="chosen")
        axis.set_yscale("log")
        axis.set_ylabel(f"{part}: KL to dense")
        axis.legend(fontsize=7, ncols=4)
    axes[-1, 0].set_xlabel("layer")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def layer_table(
    scores: Mapping[str, Mapping[int, Mapping[str, float]]], chosen: Mapping[str, Mapping[int, str]]
) -> Sequence[str]:
    """A markdown table: per layer, the chosen candidate of each sub-block and its score."""
    layers = sorted({layer for part in scores.values() for layer in part})
    lines = ["| layer | attention | KL | mlp | KL |", "| ---: | --- | ---: | --- | ---: |"]
    for layer in layers:
        cells = [str(layer)]
        for part in ("attention", "mlp"):
            name = chosen.get(part, {}).get(layer, "-")
            value = scores.get(part, {}).get(layer, {}).get(name)
            cells += [name, f"{value:.4g}" if value is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


__all__ = ["layer_table", "plot_scores"]
