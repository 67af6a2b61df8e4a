"""The ``slimkit`` command line (Typer).

``slimkit recipe list|show|validate|run``, ``slimkit eval``, ``slimkit inspect``. Input problems
(:class:`SlimkitError`) print one line, ``error: ...``, and exit with status 2; no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from slimkit.primitives.errors import SlimkitError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Structured compression of transformer LMs.")
recipe_app = typer.Typer(no_args_is_help=True, help="List, show, validate and run recipes.")
app.add_typer(recipe_app, name="recipe")

SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override a recipe field: dotted.path=value (repeatable).")
]


def _console():
    from rich.console import Console

    return Console()


def _split_csv(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


@recipe_app.command("list")
def recipe_list() -> None:
    """List the bundled recipes."""
    from rich.table import Table

    from slimkit.recipes.loading import bundled_recipes, load_recipe

    table = Table("recipe", "target", "description")
    for name in sorted(bundled_recipes()):
        recipe, _ = load_recipe(name)
        table.add_row(name, f"{recipe.target.ratio:g} of {recipe.target.of}", recipe.description)
    _console().print(table)


@recipe_app.command("show")
def recipe_show(name: str) -> None:
    """Print a recipe's YAML."""
    from slimkit.recipes.loading import recipe_path

    typer.echo(recipe_path(name).read_text(), nl=False)


@recipe_app.command("validate")
def recipe_validate(file: str, overrides: SetOption = None) -> None:
    """Check a recipe file (or bundled name) against the schema and the stage registry."""
    from slimkit.recipes.loading import load_recipe

    recipe, _ = load_recipe(file, overrides)
    stages = ", ".join(s.stage for s in recipe.flat_stages())
    typer.echo(f"ok: {recipe.name} ({recipe.target.ratio:g} of {recipe.target.of}; stages: {stages})")


@recipe_app.command("run")
def recipe_run(
    recipe: Annotated[str, typer.Argument(help="Bundled recipe name or path to a recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    model: Annotated[str | None, typer.Option("--model", help="Model source or local folder.")] = None,
    overrides: SetOption = None,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the recipe's evaluations.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty output directory.")] = False,
) -> None:
    """Compress a model with a recipe; writes OUT/model, OUT/report.json and OUT/report.md."""
    from slimkit.recipes.loading import load_recipe
    from slimkit.recipes.progress import RichTracker
    from slimkit.recipes.runner import check_output_dir, run_recipe

    all_overrides = list(overrides or [])
    if model is not None:
        all_overrides.append(f"model={model}")
    parsed, raw = load_recipe(recipe, all_overrides)
    check_output_dir(out, force)
    run_recipe(parsed, raw, out, force=force, run_eval=not no_eval, tracker=RichTracker())
    typer.echo((out / "report.md").read_text())


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Argument(help="Model source name or folder (e.g. smollm2-135m, runs/x/model).")],
    ppl: Annotated[
        str | None,
        typer.Option("--ppl", help="Comma-separated perplexity datasets (default wikitext2, none with --glue)."),
    ] = None,
    zeroshot: Annotated[str | None, typer.Option("--zeroshot", help="Comma-separated zero-shot tasks.")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Samples per zero-shot task / GLUE dev set.")] = None,
    glue: Annotated[
        str | None, typer.Option("--glue", help="GLUE task (sst2, mrpc, rte, stsb): dev-set metrics of a task model.")
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Perplexity window length.")] = 512,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Perplexity token budget (0 = whole test set).")
    ] = 16384,
    speed: Annotated[bool, typer.Option("--speed", help="Also measure prefill/decode tokens per second.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
) -> None:
    """Evaluate a model: perplexity, zero-shot accuracy through lm-eval, GLUE dev metrics, throughput."""
    from pydantic import ValidationError
    from rich.table import Table

    from slimkit.primitives.evaluate.counting import count_params
    from slimkit.primitives.sources import load_source
    from slimkit.recipes.progress import RichTracker
    from slimkit.recipes.runner import Timings, evaluate, preflight_data
    from slimkit.recipes.schema import EvalConfig, format_validation_error

    if ppl is None:
        ppl = "" if glue else "wikitext2"
    config = {
        "perplexity": {"datasets": _split_csv(ppl), "seq_len": seq_len, "max_tokens": max_tokens or None}
        if ppl
        else None,
        "zeroshot": {"tasks": _split_csv(zeroshot), "limit": limit} if zeroshot else None,
        "speed": speed,
        "glue": {"task": glue, "limit": limit} if glue else None,
    }
    try:
        eval_config = EvalConfig.model_validate(config)
    except ValidationError as error:
        raise SlimkitError(f"slimkit eval: {format_validation_error(error)}") from None
    preflight_data(eval_config, None)
    loaded, tokenizer, info = load_source(model)
    metrics, details = evaluate(loaded, tokenizer, eval_config, RichTracker(), Timings())
    table = Table("metric", "value")
    table.add_row("parameters", f"{count_params(loaded):,}")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}")
    for item in details.get("perplexity", []):
        table.add_row(
            f"{item['dataset']} windows", f"{item['windows']} x {item['seq_len']} = {item['tokens']:,} tokens"
        )
    if "glue" in details:
        table.add_row("glue dev examples", f"{details['glue']['task']}: {details['glue']['examples']}")
    if "speed" in details:
        table.add_row("prefill tokens/s", f"{details['speed']['prefill_tokens_per_s']:.1f}")
        table.add_row("decode tokens/s", f"{details['speed']['decode_tokens_per_s']:.1f}")
    _console().print(table)
    if json_out is not None:
        json_out.write_text(json.dumps({"model": info.name, "metrics": metrics, "details": details}, indent=2) + "\n")


@app.command("inspect")
def inspect_command(model: Annotated[str, typer.Argument(help="Model source name or folder.")]) -> None:
    """Per-layer widths and parameter counts of a model."""
    from rich.table import Table

    from slimkit.primitives.arch import ModelView
    from slimkit.primitives.evaluate.counting import params_by_part
    from slimkit.primitives.sources import load_source

    loaded, _tokenizer, info = load_source(model)
    view = ModelView(loaded)
    table = Table("layer", "heads", "kv heads", "head dim", "mlp width", "parameters", title=info.name)
    for layer in view.layers:
        table.add_row(
            str(layer.index),
            str(layer.num_heads),
            str(layer.num_kv_heads),
            str(layer.head_dim),
            str(layer.mlp_width),
            f"{layer.num_params():,}",
        )
    _console().print(table)
    parts = params_by_part(loaded)
    _console().print(
        f"{view.spec.model_type}: hidden {view.hidden_size}, {view.num_layers} layers, "
        f"{parts['total']:,} parameters (embeddings {parts['embeddings']:,}, attention {parts['attention']:,}, "
        f"mlp {parts['mlp']:,}, tied head: {view.tied})"
    )


def main() -> None:
    """Entry point: runs the Typer app, turning input errors into one line and exit status 2."""
    try:
        # Without standalone mode Typer returns the exit code of an interrupted command (130).
        code = app(standalone_mode=False)
    except SlimkitError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:  # Click usage errors arrive here with standalone_mode=False
        import click

        if isinstance(error, click.exceptions.ClickException):
            error.show()
            sys.exit(error.exit_code)
        if isinstance(error, click.exceptions.Exit):
            sys.exit(error.exit_code)
        if isinstance(error, click.exceptions.Abort):
            print("aborted", file=sys.stderr)
            sys.exit(1)
        raise
    if isinstance(code, int) and code != 0:
        if code == 130:
            print("interrupted", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
