"""Perplexity against llama.cpp speed: a grid's quality joined with ``benchmarks.speed --backend llama.cpp``.

    python -m benchmarks.tradeoff benchmarks/results/DATE-deploy.json runs/speed-f16.json runs/speed-q8_0.json \
        --out benchmarks/results/DATE-deploy-tradeoff

The grid (:mod:`benchmarks.run`) measures quality in PyTorch; llama.cpp speed is measured apart, in one
interleaved run of every model against dense (:mod:`benchmarks.speed`, one JSON per GGUF type), because a
fair speed ratio needs the models measured side by side on an otherwise idle machine. This joins the two:
each speed row names a model folder (``.../RUN/model``), which is the ``run_folder`` of one grid row
(a seeded row's draw); the point takes the decision row's quality (a seeded row: the mean of its draws)
and the llama.cpp numbers of the model measured. The baseline of every speed file must be the grid's
dense model, and every measured model must be a grid row: anything else is an error, not a dropped point.

Writes ``OUT.md`` (one table row per grid row and GGUF type: perplexity x dense, GGUF size x dense,
prefill and decode x dense) and ``OUT.png`` (perplexity x dense against prefill and decode speed-up).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file
from benchmarks.core.outputs import write_text
from benchmarks.core.tables import pyplot, series_color
from benchmarks.seeds import decision_rows


class TradeoffError(BenchError):
    """A speed file that cannot be joined with the grid (the message is the one line to print)."""


@dataclass(frozen=True)
class TradeoffPoint:
    """One grid row in one GGUF type: its quality relative to dense and its llama.cpp speed relative to dense."""

    row: str
    recipe: str
    ratio: float
    gguf_type: str
    measured_folder: str
    """The run folder whose model llama.cpp measured (for a seeded row: one of its draws)."""
    draws: int
    wikitext2_x: float | None
    ptb_x: float | None
    size_x: float
    prefill_x: float
    decode_x: float
    architecture: str


def _folder_of(model: str) -> str:
    """``.../deploy-r20_seed0/model`` -> ``deploy-r20_seed0``; a folder given without ``/model`` is itself."""
    path = Path(model)
    return path.parent.name if path.name == "model" else path.name


def _ratio(value: Any, dense: Any) -> float | None:
    if isinstance(value, int | float) and isinstance(dense, int | float) and dense:
        return float(value) / float(dense)
    return None


def tradeoff_points(grid: dict[str, Any], speed_runs: list[dict[str, Any]]) -> list[TradeoffPoint]:
    """The joined points, in the speed files' order (see the module docstring). Raises
    :class:`TradeoffError` for a speed file whose baseline is not the grid's model, a measured model that
    is no grid row's folder, or a speed file that is not llama.cpp's."""
    rows = grid.get("rows", [])
    dense = next((r for r in rows if r.get("id") == "dense"), None)
    if dense is None:
        raise TradeoffError("the grid has no dense row to compare against")
    dense_metrics = dense.get("metrics") or {}
    decided = {r["id"]: r for r in decision_rows(rows)}
    by_folder: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("run_folder") and row.get("status") == "ok":
            by_folder[Path(row["run_folder"]).name] = decided.get(row.get("seed_of") or row["id"], row)
    model = (grid.get("settings") or {}).get("model")
    points = []
    for run in speed_runs:
        settings = run.get("settings") or {}
        if settings.get("backend") != "llama.cpp":
            raise TradeoffError(f"speed file backend is {settings.get('backend')!r}; llama.cpp is needed")
        measured = run.get("rows") or []
        if not measured or measured[0].get("model") != model:
            first = measured[0].get("model") if measured else None
            raise TradeoffError(f"speed file baseline is {first!r}; the grid's dense model {model!r} must come first")
        base_bytes = measured[0]["export"]["bytes"]
        for entry in measured[1:]:
            folder = _folder_of(entry["model"])
            row = by_folder.get(folder)
            if row is None:
                raise TradeoffError(f"speed row {entry['model']!r}: folder {folder!r} is no finished row of the grid")
            metrics = row.get("metrics") or {}
            points.append(
                TradeoffPoint(
                    row=row["id"],
                    recipe=row.get("recipe", row["id"]),
                    ratio=float(row.get("ratio") or 0.0),
                    gguf_type=settings.get("type", "?"),
                    measured_folder=folder,
                    draws=int(row.get("draws", 1)),
                    wikitext2_x=_ratio(metrics.get("wikitext2_ppl"), dense_metrics.get("wikitext2_ppl")),
                    ptb_x=_ratio(metrics.get("ptb_ppl"), dense_metrics.get("ptb_ppl")),
                    size_x=entry["export"]["bytes"] / base_bytes,
                    prefill_x=float(entry["prefill_ratio"]),
                    decode_x=float(entry["decode_ratio"]),
                    architecture=entry["export"].get("architecture", "?"),
                )
            )
    return points


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def tradeoff_table(points: list[TradeoffPoint]) -> list[str]:
    """Markdown: one line per point, sorted by type, then recipe and ratio."""
    out = [
        "| row | GGUF | WikiText-2 x dense | PTB x dense | file x dense | prefill x dense | decode x dense | "
        "llama.cpp arch | speed measured on |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for p in sorted(points, key=lambda p: (p.gguf_type, p.recipe, p.ratio)):
        draws = f" (quality: mean of {p.draws})" if p.draws > 1 else ""
        out.append(
            f"| {p.row}{draws} | {p.gguf_type} | {_x(p.wikitext2_x)} | {_x(p.ptb_x)} | {p.size_x:.3f} | "
            f"{p.prefill_x:.2f} | {p.decode_x:.2f} | {p.architecture} | {p.measured_folder} |"
        )
    return out


def plot_tradeoff(points: list[TradeoffPoint], path: Path, title: str) -> Path | None:
    """WikiText-2 perplexity x dense against llama.cpp prefill and decode speed-up x dense: one panel each,
    a colour per recipe, a marker per GGUF type, each point labelled with its ratio; dense is the star at (1, 1)."""
    shown = [p for p in points if p.wikitext2_x is not None]
    if not shown:
        return None
    plt = pyplot()
    recipes = list(dict.fromkeys(p.recipe for p in shown))
    markers = dict(zip(dict.fromkeys(p.gguf_type for p in shown), "os^Dv", strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for axis, (field, name) in zip(axes, (("prefill_x", "prefill"), ("decode_x", "decode")), strict=True):
        for p in shown:
            colour = series_color(plt, recipes.index(p.recipe))
            axis.plot(getattr(p, field), p.wikitext2_x, markers[p.gguf_type], color=colour)
            axis.annotate(
                f"{p.ratio:.0%}",
                (getattr(p, field), p.wikitext2_x),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        axis.plot([1.0], [1.0], "k*", markersize=12)
        axis.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
        axis.set_xlabel(f"llama.cpp {name} speed x dense (higher is faster)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("WikiText-2 perplexity x dense (lower is better)")
    handles = [
        plt.Line2D([], [], color=series_color(plt, i), marker="o", linestyle="", label=r) for i, r in enumerate(recipes)
    ]
    handles += [plt.Line2D([], [], color="k", marker=m, linestyle="", label=f"GGUF {t}") for t, m in markers.items()]
    handles.append(plt.Line2D([], [], color="k", marker="*", linestyle="", markersize=10, label="dense"))
    axes[1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.tradeoff", __doc__)
    parser.add_argument("grid", type=arg.input_file, help="a grid result (benchmarks.run's JSON)")
    parser.add_argument("speed", type=arg.input_file, nargs="+", help="benchmarks.speed --backend llama.cpp --json")
    parser.add_output_base("--out", (".md", ".png"), required=True, help="writes OUT.md and OUT.png")
    args = parser.parse(argv)
    grid = read_json_file(args.grid, "GRID")
    runs = [read_json_file(path, "SPEED") for path in args.speed]
    try:
        points = tradeoff_points(grid, runs)
        settings = [dict(r["settings"]) for r in runs]
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise BenchError(f"GRID or SPEED is not what benchmarks.run / benchmarks.speed write ({error!r})") from None
    lines = [
        f"# Perplexity against llama.cpp speed: {args.grid.name}",
        "",
        "Quality from the grid (PyTorch, the row's mean over its seeds); speed from one interleaved llama.cpp run "
        "per GGUF type against dense (median of the rounds):",
        *(
            f"- {', '.join(f'{k} {v}' for k, v in s.items())} ({p.name})"
            for s, p in zip(settings, args.speed, strict=True)
        ),
        "",
        *tradeoff_table(points),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot = plot_tradeoff(points, args.out.with_suffix(".png"), "perplexity against llama.cpp speed-up")
    if plot is not None:
        lines.append(f"![perplexity against llama.cpp speed]({plot.name})")
    write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n", "--out")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
